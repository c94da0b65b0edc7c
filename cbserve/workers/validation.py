"""Every check of a request's engine arguments, in one place: the manager and the engine call
these at submission, and each raises `InvalidRequestError` naming the field and its range."""

from __future__ import annotations

import dataclasses
import math
import re
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
# A cache_salt is hashed once per request; the bound keeps a salt from being a payload of its own.
MAX_CACHE_SALT_CHARS = 1024
# A request's share of the engine (scheduler/fair_share.py): add_request's keywords.
SCHEDULING_FIELDS = ("priority", "tenant", "parent_id")
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1  # vLLM's range (int64)
MAX_SHARE_NAME = 256  # characters of a tenant or parent id


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


def scheduling(priority_scheduling: bool, priority: Any = None, tenant: Any = None,
               parent_id: Any = None) -> dict[str, Any]:
    """A request's `Request` fields for its share of the engine: `priority` (vLLM's: lower runs
    first, default 0; another value needs `priority_scheduling`, as vLLM's needs its priority
    policy), `tenant` and `parent_id` (requests of one API call); None leaves one unset."""
    fields: dict[str, Any] = {}
    if priority is not None:
        fields["priority"] = _integer("priority", priority, PRIORITY_MIN, PRIORITY_MAX)
        if priority != 0 and not priority_scheduling:
            raise InvalidRequestError("priority", f"priority {priority} needs priority_scheduling=True in the "
                                      "engine config (only 0 is accepted without it)")
    for name, value in (("tenant", tenant), ("parent_id", parent_id)):
        if value is None:
            continue
        if not isinstance(value, str) or not 0 < len(value) <= MAX_SHARE_NAME:
            raise InvalidRequestError(name, f"{name} must be a string of 1 to {MAX_SHARE_NAME} characters, "
                                      f"got {value!r:.80}")
        fields[name] = value
    return fields


def cache_salt(value: Any) -> str | None:
    """vLLM's `cache_salt`: None, or a non-empty string of at most MAX_CACHE_SALT_CHARS."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_CACHE_SALT_CHARS:
        got = f"a string of {len(value)} characters" if isinstance(value, str) else type(value).__name__
        raise InvalidRequestError(
            "cache_salt", f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
            f"got {got}")
    return value


def speculative(value: Any) -> bool:
    """A request's `speculative`: True (the engine's speculative decoding, when configured) or False."""
    if not isinstance(value, bool):
        raise InvalidRequestError("speculative", f"speculative must be true or false, got {type(value).__name__}")
    return value


def resume_tokens(value: Any, vocab_size: int, max_new_tokens: int) -> list[int]:
    """A request's `resume_tokens` (stream migration): the output it already has, fewer tokens
    than max_new_tokens (the request must still have one to generate)."""
    if value is None:
        return []
    ids = list(_token_ids("resume_tokens", value, vocab_size)) if isinstance(value, (list, tuple)) else None
    if ids is None:
        raise InvalidRequestError("resume_tokens", f"resume_tokens must be a list of token ids, got "
                                  f"{type(value).__name__}")
    if len(ids) >= max_new_tokens:
        raise InvalidRequestError("resume_tokens", f"resume_tokens ({len(ids)} tokens) must be fewer than "
                                  f"max_new_tokens ({max_new_tokens}): nothing would be left to generate")
    return ids


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
    """The whole sequence must fit the model's context and the KV cache (a prompt alone, of an
    embedding request, is the prompt's fault)."""
    total = prompt_len + new_tokens
    for limit, what in ((max_context, "the model's context of"), (capacity_tokens, "the KV cache's")):
        if total > limit:
            suffix = "" if limit == max_context else " (num_blocks * page_size)"
            if new_tokens == 0:
                raise InvalidRequestError("input_ids", f"the prompt's {prompt_len} tokens exceed {what} {limit} "
                                          f"tokens{suffix}")
            raise InvalidRequestError(
                "max_new_tokens", f"prompt ({prompt_len} tokens) + max_new_tokens ({new_tokens}) = {total} exceeds "
                f"{what} {limit} tokens{suffix}")


def constraint_fits(grammar: Any, min_new_tokens: int, barred: Collection[int]) -> None:
    """A constraint (`structured.Grammar`) and min_new_tokens that cannot both hold are refused:
    every token a grammar allows but its stop tokens covers at least one byte (xgrammar never
    allows one that decodes to nothing), so an output of at most B bytes can only end by B tokens;
    when min_new_tokens > B bars the grammar's every stop token (`barred`: the tokens barred
    before it), no token is left to draw. Refused only when B is certain."""
    if grammar is None or min_new_tokens <= 0 or not set(grammar.stop_token_ids) <= set(barred):
        return
    most = grammar.max_output_bytes
    if most is not None and most < min_new_tokens:
        raise InvalidRequestError(
            "min_tokens", f"min_tokens ({min_new_tokens}) and {grammar.field} cannot both hold: every output "
            f"{grammar.field} allows is at most {most} bytes, so it ends within {most} tokens; give min_tokens "
            f"<= {most} or a longer constraint")


def _number(name: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    ok = _is_number(value) and math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise InvalidRequestError(name, f"{name} must be a number in {bracket}{low:g}, {high:g}], got {value!r}")
    return float(value)


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if not (_is_int(value) and low <= value <= high):
        raise InvalidRequestError(name, f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _token_ids(name: str, value: Any, vocab_size: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple, set, frozenset)) or any(not _is_int(t) or not 0 <= t < vocab_size
                                                                  for t in value):
        raise InvalidRequestError(name, f"{name} must be a list of token ids in [0, {vocab_size}), got {value!r}")
    return tuple(value)


def _logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, dict):
        raise InvalidRequestError("logit_bias", f"logit_bias must map token ids to biases, got {value!r}")
    pairs = []
    for token, bias in value.items():
        # ASCII digits only: isdigit() takes "²", which int() refuses; at most 19 of them, so int()
        # never meets Python's 4,300-digit limit.
        if isinstance(token, str) and re.fullmatch(r"-?[0-9]{1,19}", token.strip()):
            token = int(token)
        if not (_is_int(token) and 0 <= token < vocab_size):
            shown = token[:40] + "..." if isinstance(token, str) and len(token) > 40 else token
            raise InvalidRequestError("logit_bias", f"logit_bias: {shown!r} is not a token id in [0, {vocab_size})")
        pairs.append((token, _number("logit_bias", bias, -100, 100)))
    return tuple(pairs)


# Per-request options beyond temperature/top_k/top_p/seed: name -> checker(value, vocab) -> field value.
OPTIONS: dict[str, Any] = {
    "min_p": lambda v, _: ("min_p", _number("min_p", v, 0, 1)),
    "repetition_penalty": lambda v, _: ("repetition_penalty", _number("repetition_penalty", v, 0, 2**31, True)),
    "presence_penalty": lambda v, _: ("presence_penalty", _number("presence_penalty", v, -2, 2)),
    "frequency_penalty": lambda v, _: ("frequency_penalty", _number("frequency_penalty", v, -2, 2)),
    "logit_bias": lambda v, vocab: ("logit_bias", _logit_bias(v, vocab)),
    "min_tokens": lambda v, _: ("min_new_tokens", _integer("min_tokens", v, 0, 2**31 - 1)),
    "ignore_eos": lambda v, _: ("ignore_eos", _flag("ignore_eos", v)),
    "stop_token_ids": lambda v, vocab: ("stop_token_ids", _token_ids("stop_token_ids", v, vocab)),
    "top_logprobs": lambda v, _: ("top_logprobs", _integer("top_logprobs", v, 0, MAX_TOP_LOGPROBS)),
    "logprobs": lambda v, _: ("logprobs", _flag("logprobs", v)),
    "prompt_logprobs": lambda v, _: ("prompt_logprobs", _integer("prompt_logprobs", v, 0, MAX_TOP_LOGPROBS)),
}
MAX_TOP_LOGPROBS = 20


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(name, f"{name} must be true or false, got {value!r}")
    return value


def _check_sampling(temperature: Any, top_k: Any, top_p: Any, seed: Any) -> None:
    if temperature is not None and not (_is_number(temperature) and 0 <= temperature < math.inf):
        raise InvalidRequestError("temperature", f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and not (_is_int(top_k) and 0 <= top_k <= MAX_TOP_K):
        raise InvalidRequestError("top_k", f"top_k must be an integer in [0, {MAX_TOP_K}] (0 = off), got {top_k!r}")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise InvalidRequestError("top_p", f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and not (_is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        raise InvalidRequestError("seed", f"seed must be an integer in [-2**63, 2**64 - 1], got {seed!r}")


def sampling(base: SamplingParams, allowed: bool, vocab_size: int, temperature: Any = None, top_k: Any = None,
             top_p: Any = None, seed: Any = None, **options: Any) -> SamplingParams | None:
    """A request's own sampling over the engine's defaults `base`; None when it sets none.
    `allowed`: the config's per_request_processors. `options`: the names of `OPTIONS`."""
    given = [name for name, v in zip(SAMPLING_FIELDS, (temperature, top_k, top_p, seed)) if v is not None]
    given += [name for name, v in options.items() if v is not None]
    if not given:
        return None
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"unexpected arguments: {unknown}")
    if not allowed:
        raise InvalidRequestError(
            given[0], "per-request sampling options (temperature, top_k, top_p, seed, penalties, ...) need "
            "per_request_processors=True in the ContinuousBatchingConfig")
    _check_sampling(temperature, top_k, top_p, seed)
    fields = dict(OPTIONS[name](value, vocab_size) for name, value in options.items() if value is not None)
    if temperature is not None or top_k is not None or top_p is not None or seed is not None:
        fields["do_sample"] = True
    return dataclasses.replace(
        base,
        temperature=(base.temperature if temperature is None
                     else 0.0 if temperature < MIN_SAMPLING_TEMPERATURE else float(temperature)),
        top_k=base.top_k if top_k is None else top_k,
        top_p=base.top_p if top_p is None else float(top_p),
        seed=seed,
        **fields,
    )
