"""Tensor parallelism under torchrun: every rank runs this script.

    torchrun --nproc-per-node 3 examples/tp_torchrun.py --max-new-tokens 32

Every rank loads only its own shard of the model (`load_model_shard`) and makes the same calls. `generate_batch` runs on every rank and
returns the same outputs everywhere (rank 0 schedules and samples, every rank runs its shard of
the forward pass). The online manager lives on rank 0; the other ranks follow it with
`serve_tensor_parallel_rank` until it is destroyed.

The default model (SmolLM2-135M) has 3 KV heads: run it with 1 or 3 processes.
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist
from transformers import GenerationConfig

import cbserve
from cbserve.__main__ import chat_prompt_ids
from cbserve.models import load_model_shard

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    # Each rank reads its slices of the checkpoint: no process ever holds the whole model.
    model, tokenizer = load_model_shard(args.model, rank, world)
    config = cbserve.ContinuousBatchingConfig(tp_size=world, tp_launcher="torchrun")
    generation_config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False,
                                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    inputs = [chat_prompt_ids(tokenizer, prompt) for prompt in PROMPTS]

    # Offline: the same call on every rank, the same outputs on every rank.
    outputs = cbserve.generate_batch(model, inputs, generation_config, config, progress_bar=False)
    answers = [tokenizer.decode(out.generated_tokens, skip_special_tokens=True) for out in outputs.values()]
    print(f"[rank {rank}/{world}] generate_batch: {answers}", flush=True)

    # Online: a streaming request through the manager on rank 0.
    if rank == 0:
        with cbserve.continuous_batching(model, generation_config, config) as manager:
            request_id = manager.add_request(inputs[0], streaming=True)
            pieces = [tokenizer.decode(out.new_tokens) for out in manager.request_id_iter(request_id)]
        print(f"[rank 0/{world}] manager, streamed: {pieces}", flush=True)
    elif world > 1:
        cbserve.serve_tensor_parallel_rank(model, config)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
