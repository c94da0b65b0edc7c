"""Command line: `python -m cbserve generate --prompt "..." [--prompt ...]`."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from transformers import GenerationConfig, PreTrainedTokenizerBase


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cbserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="answer chat prompts with the continuous-batching engine")
    gen.add_argument("--prompt", action="append", required=True, help="a user message; repeat for more")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128, help="per request (default 128)")
    gen.add_argument("--model", default=None, help="HF id (local cache), folder or .gguf; default SmolLM2")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="model dtype; auto (default): bfloat16 where the CPU has native bfloat16 dot products "
                     "(AVX-512 BF16 or AMX), else float32")
    gen.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default: engine's)")
    gen.add_argument("--tp-size", type=_positive_int, default=1,
                     help="tensor-parallel ranks (local processes); must divide the model's KV heads")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    gen.set_defaults(func=cmd_generate)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The token ids of one user message in the model's chat template, ready for the assistant's answer."""
    messages = [{"role": "user", "content": prompt}]
    if tokenizer.chat_template is None:
        return list(tokenizer(prompt)["input_ids"])
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from cbserve.api import generate_batch
    from cbserve.config import ContinuousBatchingConfig
    from cbserve.models import load_model, load_model_shard

    try:
        cb_config = ContinuousBatchingConfig(
            **({} if args.page_size is None else {"page_size": args.page_size}), tp_size=args.tp_size
        )
    except ValueError as error:
        print(f"error: invalid engine setting: {error}", file=sys.stderr)
        return 2
    try:  # with --tp-size N, rank 0's shard only (each rank reads its own); a bad size is refused here
        model, tokenizer = (load_model(args.model, dtype=args.dtype) if args.tp_size == 1
                            else load_model_shard(args.model, 0, args.tp_size, dtype=args.dtype))
    except ValueError as error:
        if args.tp_size == 1:
            raise
        print(f"error: --tp-size: {error}", file=sys.stderr)
        return 2
    inputs = [chat_prompt_ids(tokenizer, prompt) for prompt in args.prompt]
    generation_config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    start = time.perf_counter()
    outputs = generate_batch(
        model,
        inputs,
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        progress_bar=not args.no_progress,
    )
    elapsed = time.perf_counter() - start
    total_tokens = 0
    failed = 0
    for index, prompt in enumerate(args.prompt):
        output = outputs[f"req_{index}"]
        total_tokens += len(output.generated_tokens)
        print(f"[{index}] {prompt}")
        if output.error is not None:
            failed += 1
            print(f"    error: {output.error}")
        answer = tokenizer.decode(output.generated_tokens, skip_special_tokens=True).strip()
        print(f"    {answer}" if answer else "    (empty answer)")
        print()
    rate = total_tokens / elapsed if elapsed > 0 else float("inf")
    print(f"{len(inputs)} requests, {total_tokens} output tokens in {elapsed:.2f} s: {rate:.1f} tok/s")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
