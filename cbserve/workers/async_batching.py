"""Async batching: the host schedules and prepares step N+1 while the device runs step N.

A launched step leaves its sampled tokens on the device (`InFlightStep`). The next `step()`
schedules its requests as decodes of a token it has not seen yet (`Request.num_inflight`): their
input ids are filled in on the device from the launched step's tokens, so step N+1 is queued
behind step N without waiting for it. Only then does the host read step N's tokens (one
synchronisation per step instead of a stall before every launch) and update the requests.

Consequences, by design: a request that stops on EOS at step N was already scheduled into
step N+1; that row is computed and dropped (its pages are freed at once: later steps' kernels
run after N+1 on the same stream). Steps with sampled (non-greedy) requests run synchronously,
as their sampler uses host generators. On a CPU everything runs in order anyway (no overlap to
gain); the config refuses `use_async_batching=True` without CUDA, and the tests drive this logic
on a CPU by switching it on after construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbserve.scheduler.request import Request
from cbserve.scheduler.scheduler import StepResult


def wanted(config, has_graphs: bool, tensor_parallel: bool) -> bool:
    """`use_async_batching`, or for None: on with CUDA graphs (transformers' rule), unless each step's
    tokens must be on the host before the next is planned (speculation verifies them there; tensor
    parallel ranks get host inputs)."""
    if config.use_async_batching is not None:
        return bool(config.use_async_batching)
    return has_graphs and not tensor_parallel and config.speculative is None


@dataclass
class InFlightStep:
    """A launched step whose greedy tokens (and log-probabilities) are still on the device."""

    requests: list[Request]  # sampled requests, in the order of `tokens`
    tokens: torch.Tensor  # [rows] int64, on the device
    host_tokens: torch.Tensor  # its copy on the host (pinned, in flight on CUDA)
    host_logprobs: torch.Tensor | None
    done: torch.cuda.Event | None  # recorded after the copies (None on a CPU: already done)

    @property
    def rows(self) -> dict[int, int]:
        """id(request) -> row of its token in `tokens`."""
        return {id(r): i for i, r in enumerate(self.requests)}

    def results(self) -> StepResult:
        """Wait for the copies; the tokens and log-probabilities, for the scheduler."""
        if self.done is not None:
            self.done.synchronize()
        logprobs = None if self.host_logprobs is None else self.host_logprobs.tolist()
        return StepResult(self.host_tokens.tolist(), logprobs, None, list(self.requests))


def launch_greedy(logits: torch.Tensor, requests: list[Request], want_logprobs: bool) -> InFlightStep:
    """Greedy tokens of `logits` [rows, vocab] (float32) chosen on its device, copied to the host
    without blocking. Same choice and log-probability as `Sampler` for greedy rows."""
    tokens = logits.argmax(dim=-1)
    logprobs = logits.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1) if want_logprobs else None
    if not logits.is_cuda:
        return InFlightStep(requests, tokens, tokens, logprobs, None)
    host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host_tokens.copy_(tokens, non_blocking=True)
    host_logprobs = None
    if logprobs is not None:
        host_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
        host_logprobs.copy_(logprobs, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return InFlightStep(requests, tokens, host_tokens, host_logprobs, done)
