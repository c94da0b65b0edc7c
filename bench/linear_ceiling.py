"""The linear layers' ceiling for a workload: the output tokens per second cbserve would reach if its
linear layers ran every FLOP of the workload at the best rate its packed kernel reaches on this
CPU, and nothing else took any time (attention, norms, sampling, Python: free).

Issue 28 asks for 1.5x vLLM's CPU engine on the mixed workload; vLLM runs the same linears (the same
FLOPs), so when 1.5x vLLM's measured figure is above this ceiling, the target cannot be met by
faster kernels or less overhead, only by fewer or cheaper FLOPs (other weights, another dtype).

    .venv/bin/python bench/linear_ceiling.py --workload mixed --dtypes bfloat16,float32 \\
        --peer bfloat16=330 --peer float32=182
    .venv/bin/python bench/linear_ceiling.py --workload served --dtypes bfloat16 --peer bfloat16=505

`served` is bench/peers.py's served load (every request --prompt-tokens -> --max-tokens): its ceiling
does not depend on the number of clients, only on the prompt / output ratio.

FLOPs: 2 per weight for every prompt and output token through the decoder's linears, plus the LM
head for each output token (one logits row per generated token; prompts' other rows need none).
The rate: the default model's layer shapes (fused q/k/v, o, fused gate/up, down; 30 layers of
their own weights, so they stream from memory as in the engine) and its LM head through
`PackedLinear` as the engine builds it, at several row counts; the best is kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # bench/common.py, beside this file


def workload_tokens(name: str, seed: int, prompt_tokens: int, max_tokens: int) -> tuple[int, int]:
    """(prompt tokens, output tokens) of a bench workload: its shapes do not depend on the ids."""
    if name == "served":  # one request stands for all: the ratio is what counts
        return prompt_tokens, max_tokens
    work = common.make_workload(name, list(range(1000)), None, seed)
    return sum(len(p) for p in work.prompts), sum(work.lengths)


def layer_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears as the lean forward fuses them."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    return [(hidden, hidden + 2 * kv), (config.num_attention_heads * head_dim, hidden), (hidden, 2 * inter),
            (inter, hidden)]


def linear_weights(config) -> tuple[int, int]:
    """(the decoder's linear weights over all layers, the LM head's weights)."""
    return (sum(i * o for i, o in layer_shapes(config)) * config.num_hidden_layers,
            config.hidden_size * config.vocab_size)


def best_rate(config, dtype: torch.dtype, rows_list: list[int], repeat: int) -> tuple[float, dict[int, float]]:
    """The best GFLOPS over `rows_list` of every layer's linears then the LM head, and each row count's."""
    from cbserve.kernels.packed_linear import PackedLinear

    torch.manual_seed(0)
    layers = [[PackedLinear(torch.nn.Linear(i, o, bias=False, dtype=dtype)) for i, o in layer_shapes(config)]
              for _ in range(config.num_hidden_layers)]
    head = PackedLinear(torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype))
    flops_per_row = 2 * sum(linear_weights(config))
    rates: dict[int, float] = {}
    with torch.inference_mode():
        for rows in rows_list:
            inputs = {i: torch.randn(rows, i, dtype=dtype) for i in {i for i, _ in layer_shapes(config)}}
            best = float("inf")
            for _ in range(repeat + 1):  # the first pass warms up
                start = time.perf_counter()
                for layer in layers:
                    for linear in layer:
                        linear(inputs[linear.in_features])
                head(inputs[config.hidden_size])
                best = min(best, time.perf_counter() - start)
            rates[rows] = flops_per_row * rows / best / 1e9
    return max(rates.values()), rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="mixed",
                   choices=[w for w in common.WORKLOADS if w not in ("copy", "shared")] + ["served"])
    p.add_argument("--prompt-tokens", type=int, default=256, help="the served workload's prompt length")
    p.add_argument("--max-tokens", type=int, default=128, help="the served workload's output length")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rows", default="1,8,32,64,128,256,512,2048", help="row counts the rate is measured at")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (bench/peers.py's --seed)")
    p.add_argument("--peer", action="append", default=[], metavar="DTYPE=TOK_S",
                   help="a peer's measured tok/s in that dtype, to print the ceiling's ratio to it")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    args = p.parse_args()

    from transformers import AutoConfig

    from cbserve.models import checkpoint_folder

    config = AutoConfig.from_pretrained(str(checkpoint_folder(args.model)), local_files_only=True)
    prompt, output = workload_tokens(args.workload, args.seed, args.prompt_tokens, args.max_tokens)
    layer_weights, head_weights = linear_weights(config)
    flops = 2 * (layer_weights * (prompt + output) + head_weights * output)
    peers = {d: float(v) for d, v in (s.split("=", 1) for s in args.peer)}
    print(f"{args.workload}: {prompt} prompt + {output} output tokens; {flops / 1e12:.2f} TFLOP in the linears "
          f"({layer_weights / 1e6:.1f}M decoder weights, {head_weights / 1e6:.1f}M in the LM head); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.dtypes.split(","):
        rate, rates = best_rate(config, getattr(torch, name), [int(r) for r in args.rows.split(",")], args.repeat)
        seconds = flops / (rate * 1e9)
        ceiling = output / seconds
        print(f"{name}: GFLOPS by rows " + ", ".join(f"{r}: {g:.0f}" for r, g in rates.items()))
        line = f"{name}: best {rate:.0f} GFLOPS -> linears alone {seconds:.2f} s -> ceiling {ceiling:.0f} output tok/s"
        if name in peers:
            line += (f"; peer {peers[name]:.0f} tok/s: ceiling / peer {ceiling / peers[name]:.2f}x "
                     f"(1.5x the peer = {1.5 * peers[name]:.0f} tok/s)")
        print(line)


if __name__ == "__main__":
    main()
