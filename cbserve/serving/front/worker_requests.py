"""Building `WorkerRequest`s for every front (OpenAI HTTP, gRPC, batch): the deployment's defaults
for the fields a request leaves out, the prefix hashes the router reads, and the limits that only
a front has (the engine knows nothing of them). Values the engine checks are passed on as given.
"""

from __future__ import annotations

import contextvars
import hashlib
import re
from collections.abc import Sequence
from typing import Any

from cbserve.errors import InvalidRequestError
from cbserve.serving.front.prefix import cache_key_hashes, chat_routing_text, prefix_hashes
from cbserve.serving.front.service_args import GenerationDefaults, LimitsConfig, RoutingConfig
from cbserve.serving.protocol import Sampling, WorkerRequest


def check_limits(limits: LimitsConfig, max_tokens: int | None = None, n: int = 1, prompts: int = 1,
                 stops: Sequence[str] = ()) -> None:
    """The deployment's limits on one API request; raises InvalidRequestError naming the API field."""
    if max_tokens is not None and limits.max_tokens is not None and max_tokens > limits.max_tokens:
        raise InvalidRequestError("max_tokens", f"max_tokens must be at most {limits.max_tokens}, got {max_tokens}")
    if n > limits.max_n:
        raise InvalidRequestError("n", f"n must be at most {limits.max_n}, got {n}")
    if prompts > limits.max_prompts:
        raise InvalidRequestError("prompt", f"at most {limits.max_prompts} prompts per request, got {prompts}")
    if len(stops) > limits.max_stop:
        raise InvalidRequestError("stop", f"at most {limits.max_stop} stop strings, got {len(stops)}")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def key_tenant(api_key: str) -> str:
    """The tenant of a deployment's API key (the engine's fair share): a digest, so that neither
    the engine nor a log line ever holds the key."""
    return f"key:{_digest(api_key)}"


def user_tenant(user: str | None) -> str | None:
    """The tenant named by OpenAI's `user` field, used when the deployment has no API keys (a
    key's tenant replaces it otherwise: a client cannot pick its share by naming users)."""
    return None if not user else f"user:{_digest(user)}"


# The tenant of the API call being served (its API key's): each call runs in a task of its own,
# and the tasks opening its choices copy its context.
_CALL_TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("cbserve_call_tenant", default=None)


def bind_call_tenant(tenant: str | None) -> None:
    """The tenant of the API call this task serves (None: the requests' own, from `user`)."""
    _CALL_TENANT.set(tenant)


def with_call_tenant(wreq: WorkerRequest) -> WorkerRequest:
    """`wreq` with the tenant bound to the API call it belongs to, when one is."""
    tenant = _CALL_TENANT.get()
    if tenant is None:
        return wreq
    return wreq.model_copy(update={"sampling": wreq.sampling.model_copy(update={"tenant": tenant})})


def routing_hashes(routing: RoutingConfig, prompt: str | Sequence[int] | None = None,
                   messages: list[dict[str, str]] | None = None, cache_key: str | None = None) -> list[int]:
    """The prefix hashes of a text prompt, token ids or a chat (see `prefix.py`); the client's
    `prompt_cache_key` instead when it gives one."""
    if cache_key is not None:
        return cache_key_hashes(cache_key)
    key = chat_routing_text(messages) if messages is not None else prompt
    if key is None:
        return []
    chunk = routing.chunk_chars if isinstance(key, str) else routing.chunk_tokens
    return prefix_hashes(key, chunk, routing.max_chunks)


def sampling(gen: GenerationDefaults, temperature: float | None = None, top_p: float | None = None,
             top_k: int | None = None, **fields: Any) -> Sampling:
    """A request's sampling block: temperature, top_p and top_k left None take the deployment's
    generation defaults, or stay None (the model's own defaults, applied by the replica) where the
    deployment sets none; `fields`: the block's other fields (seed, penalties, priority, ...)."""
    return Sampling(temperature=gen.temperature if temperature is None else temperature,
                    top_p=gen.top_p if top_p is None else top_p, top_k=gen.top_k if top_k is None else top_k,
                    **fields)


def worker_request(request_id: str, hashes: list[int], sampling: Sampling, *, prompt: str | None = None,
                   max_tokens: int | None = None, stop: Sequence[str] = (), **fields: Any) -> WorkerRequest:
    """One choice, its `sampling` block as is. An empty text prompt is refused here, for every
    front (a tokenizer may turn it into a BOS token alone). `fields`: the other `WorkerRequest`
    fields (messages or prompt_ids, constraint, tools, logprobs, echo, ...)."""
    if prompt is not None and not prompt:
        raise InvalidRequestError("prompt", "prompt must not be empty")
    if max_tokens == 0 and not (fields.get("echo") or sampling.prompt_logprobs is not None):
        raise InvalidRequestError("max_tokens", "max_tokens: 0 only with echo or prompt_logprobs")
    if sampling.parent_id is None:  # a request that is no API call's choice (gRPC, a batch line) is its own parent
        sampling = sampling.model_copy(update={"parent_id": request_id})
    return WorkerRequest(request_id=request_id, prompt=prompt, max_tokens=max_tokens, stop=list(stop),
                         sampling=sampling, prefix_hashes=hashes, **fields)


# A token id as a JSON key: ASCII digits only (str.isdigit() also takes "²" and "٣", which int()
# refuses), and short enough that int() never meets Python's 4,300-digit limit.
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}")


def logit_bias(bias: dict[str, float] | None, field: str = "logit_bias") -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON keys) with integer keys; the engine checks the ids
    against the vocabulary and the [-100, 100] range."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        text = key.strip() if isinstance(key, str) else ""
        if not _TOKEN_ID_KEY.fullmatch(text):
            shown = key[:40] + "..." if isinstance(key, str) and len(key) > 40 else key
            raise InvalidRequestError(field, f"{field}: key {shown!r} is not a token id (an integer >= 0 in the "
                                      "model's vocabulary)")
        out[int(text)] = value
    return out
