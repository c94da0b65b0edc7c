"""Embeddings: requests that pool their prompt's final hidden states instead of generating.

The engine prefills an embedding request's prompt like any other (in chunks when it is long, in
a batch with generating requests), but never samples it: the runner asks the forward pass for
the final hidden state (after the model's last norm: transformers' `last_hidden_state`) of the
rows its pooling reads, each step adds them to the request's `Pooling`, and when its prompt is
computed the request finishes with the pooled vector, L2-normalized (as llama.cpp's and vLLM's
embeddings are):

- `mean`: the mean over every prompt position (llama.cpp's `--pooling mean`);
- `last`: the last prompt position's (vLLM's default for decoder-only models; what causal LMs
  trained as embedders, such as Qwen3-Embedding, expect).

Its prompt is always computed, never matched in the prefix cache (`Request.computes_whole_prompt`:
the matched positions' hidden states would be missing); its full pages are registered as any
prompt's (their K/V are exactly its tokens'), so a later generation may reuse them. A chunk
computed again after a preemption adds only the positions not pooled yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbserve.errors import InvalidRequestError
from cbserve.scheduler.request import Request

METHODS = ("mean", "last")


def check_method(method: object) -> str:
    if method not in METHODS:
        raise InvalidRequestError("pooling", f"pooling must be one of {', '.join(METHODS)}, got {method!r}")
    return method  # type: ignore[return-value]


@dataclass
class Pooling:
    """One request's pooling state: the sum of the hidden states pooled so far."""

    method: str
    prompt_len: int
    total: torch.Tensor | None = None  # float64 for a float64 model, else float32
    num_pooled: int = 0  # prompt positions pooled so far (a prefix of the prompt)
    embedding: list[float] | None = None  # the normalized result, once the prompt is computed

    def positions(self, start: int, count: int) -> range:
        """Of a chunk's positions [start, start + count), those this pooling still reads."""
        end = start + count
        if self.method == "last":
            last = self.prompt_len - 1
            return range(last, end) if start <= last < end and self.num_pooled <= last else range(end, end)
        return range(max(start, self.num_pooled), end)

    def add(self, hidden: torch.Tensor, end: int) -> None:
        """`hidden`: the final hidden states of the positions read up to `end` (exclusive)."""
        summed = hidden.to(torch.float64 if hidden.dtype == torch.float64 else torch.float32).sum(0)
        self.total = summed if self.total is None else self.total + summed
        self.num_pooled = end

    def finish(self) -> None:
        vector = self.total / (self.prompt_len if self.method == "mean" else 1)
        self.embedding = torch.nn.functional.normalize(vector, dim=0).cpu().tolist()


def add_hidden_states(hidden: torch.Tensor, chunks: list[tuple[Request, range]]) -> None:
    """A step's pooled rows (`hidden`, in the order of `chunks`) into their requests' poolings."""
    at = 0
    for request, positions in chunks:
        request.pooling.add(hidden[at:at + len(positions)], positions.stop)  # type: ignore[union-attr]
        at += len(positions)


def completed(requests: list[Request]) -> list[Request]:
    """The live embedding requests among `requests` whose prompt is computed, their vectors made."""
    done = [r for r in requests if r.pooling is not None and r.live and r.num_computed >= len(r.prompt_ids)]
    for request in done:
        request.pooling.finish()  # type: ignore[union-attr]
    return done
