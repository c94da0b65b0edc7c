"""Every check of a request's engine arguments, in one place: the manager and the engine call
these at submission, and each raises `InvalidRequestError` naming the field and its range."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from cbserve.errors import InvalidRequestError
from cbserve.scheduler.request import SamplingParams

# Bounds of what the sampler can hold: top_k goes into an int64 tensor, seed into a
# torch.Generator (int64 or uint64). Beyond them the request would fail inside a batch step.
MAX_TOP_K = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Below this a temperature is greedy: dividing float32 logits by it overflows to inf/NaN.
MIN_SAMPLING_TEMPERATURE = 1e-5
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def request_id(value: Any, live: Collection[str]) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError("request_id", f"request_id must be a non-empty string, got {value!r}")
    if value in live:
        raise InvalidRequestError("request_id", f"request_id {value!r} is already in use by a live request")
    return value


def prompt(input_ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(input_ids, (list, tuple)) or len(input_ids) == 0:
        raise InvalidRequestError("input_ids", "input_ids must be a non-empty list of token ids")
    for i, t in enumerate(input_ids):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                "input_ids", f"input_ids[{i}]: token id {t!r} is not an integer in the vocabulary [0, {vocab_size})")
    return list(input_ids)


def max_new_tokens(value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise InvalidRequestError("max_new_tokens", f"max_new_tokens must be a positive integer (>= 1), got {value!r}")
    return value


def eos_token_id(value: Any) -> None:
    if value is None:
        return
    ids = [value] if isinstance(value, int) else value
    if (isinstance(value, bool) or not isinstance(ids, (list, tuple, set, frozenset))
            or any(not _is_int(t) or t < 0 for t in ids)):
        raise InvalidRequestError(
            "eos_token_id", f"eos_token_id must be a token id (integer >= 0) or a list of them, got {value!r}")


def fits(prompt_len: int, new_tokens: int, max_context: int, capacity_tokens: int) -> None:
    """The whole sequence must fit the model's context and the KV cache."""
    total = prompt_len + new_tokens
    for limit, what in ((max_context, "the model's context of"), (capacity_tokens, "the KV cache's")):
        if total > limit:
            suffix = "" if limit == max_context else " (num_blocks * page_size)"
            raise InvalidRequestError(
                "max_new_tokens", f"prompt ({prompt_len} tokens) + max_new_tokens ({new_tokens}) = {total} exceeds "
                f"{what} {limit} tokens{suffix}")


def _check_sampling(temperature: Any, top_k: Any, top_p: Any, seed: Any) -> None:
    if temperature is not None and not (_is_number(temperature) and 0 <= temperature < math.inf):
        raise InvalidRequestError("temperature", f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and not (_is_int(top_k) and 0 <= top_k <= MAX_TOP_K):
        raise InvalidRequestError("top_k", f"top_k must be an integer in [0, {MAX_TOP_K}] (0 = off), got {top_k!r}")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise InvalidRequestError("top_p", f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and not (_is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        raise InvalidRequestError("seed", f"seed must be an integer in [-2**63, 2**64 - 1], got {seed!r}")


def sampling(base: SamplingParams, allowed: bool, temperature: Any = None, top_k: Any = None,
             top_p: Any = None, seed: Any = None) -> SamplingParams | None:
    """A request's own sampling over the engine's defaults `base`; None when it sets none.
    `allowed`: the config's per_request_processors."""
    given = [name for name, v in zip(SAMPLING_FIELDS, (temperature, top_k, top_p, seed)) if v is not None]
    if not given:
        return None
    if not allowed:
        raise InvalidRequestError(
            given[0], "temperature/top_k/top_p/seed per request need per_request_processors=True in the "
            "ContinuousBatchingConfig")
    _check_sampling(temperature, top_k, top_p, seed)
    return SamplingParams(
        do_sample=True,
        temperature=(base.temperature if temperature is None
                     else 0.0 if temperature < MIN_SAMPLING_TEMPERATURE else float(temperature)),
        top_k=base.top_k if top_k is None else top_k,
        top_p=base.top_p if top_p is None else float(top_p),
        seed=seed,
    )
