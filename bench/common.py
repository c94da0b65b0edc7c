"""What the benches share: the workloads (token-id prompts and output lengths), the greedy-token
comparisons, the machine's load average and a log's tail. Standard library only, so that a peer engine's own venv (vLLM's, for
bench/peers.py) imports it too.
"""

from __future__ import annotations

import os
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("mixed", "decode", "long", "shared", "single", "copy")
# The "copy" workload's request (speculative decoding's favourable case): a chat asking the model
# to repeat a ~170-word text, 256 new tokens (EOS ignored, so it goes on after the copy).
COPY_INSTRUCTION = "Repeat the following text exactly, word for word:\n\n"
COPY_TEXT = (
    "The lighthouse keeper kept a logbook for forty years. Every evening he wrote down the direction of the wind, "
    "the height of the waves, the ships that passed and the birds that rested on the railing. When the lamp was "
    "automated and he moved to the village, he gave the logbook to the school, where the children used it to learn "
    "how weather changes from one season to the next. They found that the storms of the autumn came earlier each "
    "decade, that the swallows arrived a week sooner than they had in his first years, and that the number of "
    "fishing boats had fallen by half. The teacher asked the old keeper to visit the class. He told them that the "
    "sea never repeats itself, but that a patient observer can still find its rhythms, and that writing things down "
    "is the only way to remember them honestly."
)
COPY_NEW_TOKENS = 256
SHARED_PREFIX_TOKENS = 512  # the "shared" workload's system prompt


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    lengths: list[int]


def make_workload(name: str, allowed_ids: list[int], requests: int | None, seed: int) -> Workload:
    """Seeded random token ids drawn from `allowed_ids` (no special tokens); `requests` shrinks it.

    - mixed: 64 requests, prompts 16-256 tokens, outputs 8-128;
    - decode: 128 x 16 -> 128;
    - long: 16 x 2,000 -> 64 (prefill);
    - shared: 64 requests of one 512-token system prompt plus 16-128 tokens of their own -> 16-64
      (prefix caching);
    - single: one stream, 256 -> 256 (decode speed at batch 1);
    - copy: one stream asked to repeat COPY_TEXT, -> 256 (built by the caller, which has the
      tokenizer: `copy_workload`).
    """
    rng = random.Random(f"{name}-{seed}")
    if name == "shared":
        return _shared_workload(rng, allowed_ids, requests or 64)
    if name == "mixed":
        n = requests or 64
        shapes = [(rng.randint(16, 256), rng.randint(8, 128)) for _ in range(n)]
    elif name == "decode":
        shapes = [(16, 128)] * (requests or 128)
    elif name == "long":
        shapes = [(2000, 64)] * (requests or 16)
    elif name == "single":
        shapes = [(256, 256)] * (requests or 1)
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    prompts = [[rng.choice(allowed_ids) for _ in range(p)] for p, _ in shapes]
    return Workload(name, prompts, [o for _, o in shapes])


def copy_workload(prompt_ids: list[int], requests: int | None) -> Workload:
    """`requests` (default 1) copies of the copy request, its ids from the model's chat template."""
    n = requests or 1
    return Workload("copy", [list(prompt_ids) for _ in range(n)], [COPY_NEW_TOKENS] * n)


def _shared_workload(rng: random.Random, allowed_ids: list[int], n: int) -> Workload:
    system = [rng.choice(allowed_ids) for _ in range(SHARED_PREFIX_TOKENS)]
    prompts = [system + [rng.choice(allowed_ids) for _ in range(rng.randint(16, 128))] for _ in range(n)]
    return Workload("shared", prompts, [rng.randint(16, 64) for _ in range(n)])


def mismatches(a: list[list[int]], b: list[list[int]]) -> list[tuple[int, int]]:
    """(request index, first differing position) for every request whose tokens differ."""
    found = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            found.append((i, common_prefix(x, y)))
    return found


def common_prefix(x: list[int], y: list[int]) -> int:
    """How many leading tokens two sequences share."""
    return next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))


def agreement(a: list[list[int]], b: list[list[int]], first: int) -> dict[str, float | int]:
    """Greedy agreement of two engines on the same requests: how many agree on their first `first`
    tokens (a request shorter than that must agree on all of them), and the mean length of the
    common prefix. bfloat16 engines drift apart after a near tie, so the first tokens are what a
    correct pair must share."""
    prefixes = [common_prefix(x, y) for x, y in zip(a, b, strict=True)]
    wanted = [min(first, len(x), len(y)) for x, y in zip(a, b, strict=True)]
    return {
        "requests": len(prefixes),
        "first": first,
        "agree_first": sum(p >= w for p, w in zip(prefixes, wanted, strict=True)),
        "identical": sum(x == y for x, y in zip(a, b, strict=True)),
        "mean_common_prefix": statistics.fmean(prefixes) if prefixes else 0.0,
    }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is 0."""
    return None if a is None or not b else a / b


def loadavg() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def log_tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log file, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
