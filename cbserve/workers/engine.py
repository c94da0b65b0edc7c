"""EngineCore: one `step()` = schedule, run the copies and the model, sample, and hand the
pass's `StepResult` to `Scheduler.update`, which does the step's bookkeeping (tokens computed,
status, pages registered, released and freed, finishing).

It knows nothing of threads, HTTP or Ray; the manager and `generate_batch` drive it, and build
it through `workers/factory.py`, which makes and wires its parts (cache, scheduler, runner,
sampler). Under tensor parallelism it is given a `TensorParallelLeader` (composition), which the
factory has already wrapped around its runner so that each step's inputs reach the other ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig

from cbserve.config import ContinuousBatchingConfig
from cbserve.errors import InvalidRequestError, RequestFault
from cbserve.kernels import packed_linear
from cbserve.outputs import FinishReason, RequestStatus
from cbserve.scheduler.request import Request, SamplingParams
from cbserve.scheduler.scheduler import StepPlan, StepResult
from cbserve.workers import async_batching, model_sharing, validation
from cbserve.workers.async_batching import InFlightStep, launch_greedy
from cbserve.workers.generation_config import sampling_params as generation_config_sampling
from cbserve.workers.model_runner import num_sampled_rows
from cbserve.workers.parallel.groups import TensorParallelError
from cbserve.workers.pooling import Pooling, add_hidden_states, check_method, completed
from cbserve.workers.sampler import prompt_logprobs
from cbserve.workers.speculative import sample_with_drafts
from cbserve.workers.structured import Grammar, check_grammar_accepts

if TYPE_CHECKING:
    from cbserve.scheduler.block_manager import BlockManager
    from cbserve.scheduler.scheduler import Scheduler
    from cbserve.workers.kv.cache import PagedKVCache
    from cbserve.workers.kv.host_pool import HostKVPool
    from cbserve.workers.lora_slots import LoraSlots
    from cbserve.workers.model_runner import ModelRunner
    from cbserve.workers.model_shape import ModelShape
    from cbserve.workers.parallel.leader import TensorParallelLeader
    from cbserve.workers.sampler import Sampler
    from cbserve.workers.sizing import EngineSizes

logger = logging.getLogger(__name__)


def _token_refused(request: Request, cause: Exception) -> RequestFault:
    """The fault of a request whose own state refused its next token (about to be appended)."""
    field = "grammar" if request.grammar is not None else "logits_processors"
    fault = RequestFault(field, f"the request's {field} refused its token at output position "
                                f"{len(request.generated)} ({type(cause).__name__})")
    fault.__cause__ = cause
    return fault


def eos_set(eos: int | list[int] | None) -> frozenset[int]:
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


@dataclass
class EngineParts:
    """What an `EngineCore` steps with, built and wired by `workers/factory.py`."""

    shape: ModelShape
    sizes: EngineSizes
    cache: PagedKVCache
    block_manager: BlockManager
    host_pool: HostKVPool | None
    node_pool: object | None  # node_client's attachment to the node's KV pool
    scheduler: Scheduler
    attention_backend: str
    runner: ModelRunner
    sampler: Sampler
    pack_weights: bool
    packed_linears: list
    lora: LoraSlots | None = None  # enable_lora: the adapters and their slots in the model's projections


def _resume(request: Request, tokens: list[int]) -> None:
    """A request continued here (stream migration) takes its output so far, which must be one it
    could go on from: its grammar allows it, it is not complete, no prompt logprobs are owed."""
    if request.sampling.prompt_logprobs is not None:
        raise InvalidRequestError("prompt_logprobs", "prompt_logprobs: not with resume_tokens (a continued "
                                  "request's prompt was answered where it began)")
    request.resume(tokens)
    if request.grammar is not None:
        check_grammar_accepts(request.grammar, tokens)
    if request.stop_reason() is not None:
        raise InvalidRequestError("resume_tokens", "resume_tokens: the output is already complete (it ends "
                                  "with a stop token or reaches max_new_tokens)")


class EngineCore:
    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig,
        config: ContinuousBatchingConfig,
        parts: EngineParts,
        parallel: TensorParallelLeader | None = None,
    ) -> None:
        """Built by `workers/factory.py`'s `build_engine`, which makes and wires the parts."""
        self.model = model
        self.config = config
        self.generation_config = generation_config
        self._default_sampling = generation_config_sampling(generation_config)  # may refuse a field
        self.shape = parts.shape
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_batch_tokens = parts.sizes.max_batch_tokens
        self.cache = parts.cache
        self.block_manager = parts.block_manager
        self.host_pool = parts.host_pool
        self.node_pool = parts.node_pool
        self.scheduler = parts.scheduler
        self.attention_backend = parts.attention_backend
        self.runner = parts.runner
        self.sampler = parts.sampler
        self._pack_weights = parts.pack_weights
        self.packed_linears = parts.packed_linears
        self.lora = parts.lora
        model_sharing.take_attention(model, self)  # the engine is the holder: dropped, it lets go
        self.holds_model = True  # its attention, linears and compiled layers are the engine's (take_model)
        self.parallel = parallel
        # Async batching (CUDA only, refused by the config elsewhere): see async_batching.py.
        self.async_batching = async_batching.wanted(config, self.runner.graphs is not None, parallel is not None)
        if self.async_batching and self.runner.graphs is None:
            logger.warning("use_async_batching without CUDA graphs: every kernel launch stays on the host "
                           "thread, so little of the next step's preparation overlaps this one")
        self._in_flight: InFlightStep | None = None
        self.requests: dict[str, Request] = {}
        self.busy_seconds = 0.0  # wall time inside step(): with the wall clock, how busy the engine was
        # Seconds spent in each phase of step(), summed: host overhead vs model time.
        self.timings = {"schedule": 0.0, "prepare": 0.0, "forward": 0.0}

    def release_model(self, result: Any = None) -> None:
        """Give the model back its own attention implementation, linear layers and eager layers;
        under tensor parallelism, shut the other ranks down (sending them `result`)."""
        self.give_back_model()
        if self.parallel is not None:
            self.parallel.close(result)

    def give_back_model(self) -> None:
        """The model's own attention implementation, linear layers and eager layers, back (a stopped
        or paused manager); `take_model` takes them again, packing the weights afresh."""
        if not self.holds_model:
            return
        if self.lora is not None:
            self.lora.detach()
        packed_linear.unpack_linears(self.packed_linears)
        self.runner.forward.restore()
        model_sharing.give_back_attention(self.model, self)
        self.holds_model = False

    def take_model(self) -> None:
        if self.holds_model:
            return
        model_sharing.take_attention(self.model, self)
        self.runner.forward.install()
        self.packed_linears = (packed_linear.pack_linears(self.model, self.config.batch_invariant)
                               if self._pack_weights else [])
        if self.lora is not None:  # around what the pass calls: packed, fused q/k/v and gate/up
            self.lora.attach()
        self.holds_model = True

    # -- requests ----------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.cache.num_blocks * self.cache.page_size

    def make_request(
        self,
        input_ids: list[int],
        request_id: str,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        eos_token_id: int | list[int] | None = None,
        sampling: SamplingParams | None = None,
        grammar: Grammar | None = None,
        resume_tokens: list[int] | None = None,
        lora: str | None = None,
        pooling: str | None = None,
    ) -> Request:
        """Validate a request at the boundary (`workers/validation.py`); every error names the
        argument and its range. `sampling`: already validated (`validation.sampling`); `grammar`: compiled
        for this model (`StructuredOutputs.compile`); `resume_tokens`: the output so far of a request
        continued here (stream migration, `Request.resume`); `lora`: a loaded adapter's name or an
        adapter folder (`resolve_lora`); `pooling`: "mean" or "last" makes it an embedding request
        (`pooling.py`: its prompt only, nothing generated)."""
        if self.parallel is not None:
            self.parallel.check_health()  # refused at the boundary: the group is gone
        validation.request_id(request_id, self.requests)
        prompt = validation.prompt(input_ids, self.shape.vocab_size)
        gc = self.generation_config
        if pooling is not None:  # an embedding: its prompt only
            max_new_tokens = 0
            for name in ("logprobs", "top_logprobs"):  # of generated tokens: an embedding has none
                if sampling is not None and getattr(sampling, name):
                    raise InvalidRequestError(name, f"{name} does not apply to an embedding request (pooling): "
                                              "it generates no tokens")
        else:
            if max_new_tokens is None:
                max_new_tokens = gc.max_new_tokens if gc.max_new_tokens is not None else 20
            validation.max_new_tokens(max_new_tokens)
        validation.eos_token_id(eos_token_id)
        validation.fits(len(prompt), max_new_tokens, self.shape.max_context, self.capacity_tokens)
        sampling = sampling or self._default_sampling
        if gc.min_length and gc.min_length - len(prompt) > sampling.min_new_tokens:  # min_length counts the prompt
            sampling = dataclasses.replace(sampling, min_new_tokens=gc.min_length - len(prompt))
        eos_ids = eos_set(eos_token_id if eos_token_id is not None else gc.eos_token_id)
        validation.constraint_fits(grammar, sampling.min_new_tokens, eos_ids | set(sampling.stop_token_ids))
        resumed = validation.resume_tokens(resume_tokens, self.shape.vocab_size, max_new_tokens)
        lora_id = self.resolve_lora(lora)
        request = Request(
            request_id=request_id,
            prompt_ids=prompt,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_ids,
            sampling=sampling,
            streaming=streaming,
            return_logprobs=self.config.return_logprobs if sampling.logprobs is None else sampling.logprobs,
            grammar=grammar,
            lora_id=lora_id,
            pooling=None if pooling is None else Pooling(check_method(pooling), len(prompt)),
        )
        if resumed:
            _resume(request, resumed)
        return request

    # -- LoRA adapters (workers/lora_slots.py) ---------------------------------------------------

    def resolve_lora(self, lora: str | None) -> int | None:
        """The adapter id of a request's `lora` (a loaded adapter's name, or a folder, loaded on
        first use); None for the base model."""
        if lora is not None and self.lora is None:
            raise InvalidRequestError("lora", f"lora={lora!r} needs an engine built with enable_lora=True")
        return None if self.lora is None else self.lora.resolve(lora)

    def load_lora(self, name: str, path: str) -> None:
        if self.lora is None:
            raise InvalidRequestError("lora_name", "loading LoRA adapters needs an engine built with enable_lora=True")
        self.lora.load(name, path)

    def unload_lora(self, name: str, live: list[Request]) -> None:
        """Forget adapter `name`; refused while a request of `live` (the caller's, not yet
        finished, queued ones included) uses it."""
        if self.lora is None or name not in self.lora.ids:
            raise InvalidRequestError("lora_name", f"no LoRA adapter named {name!r} is loaded")
        users = [r.request_id for r in live if r.lora_id == self.lora.ids[name] and r.live]
        if users:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is used by {len(users)} unfinished requests "
                                      f"({', '.join(users[:5])}); unload it when they are done")
        self.lora.unload(name)

    def list_loras(self) -> dict[str, str]:
        """Loaded adapters: name -> folder."""
        return {} if self.lora is None else {name: a.path for name, a in self.lora.adapters.items()}

    def default_sampling(self) -> SamplingParams:
        return self._default_sampling

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def _forget(self, request: Request) -> None:
        """A request the scheduler finished leaves the engine: its sampler state is dropped."""
        if self.requests.get(request.request_id) is request:
            self.sampler.forget(request.request_id)
            del self.requests[request.request_id]

    def cancel_request(self, request_id: str) -> Request | None:
        """Stop a live request now and free its pages; None when unknown or already done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, RequestStatus.CANCELLED, FinishReason.CANCELLED)
        self._forget(request)
        return request

    def fail_all(self, error: BaseException) -> list[Request]:
        """Fail every live request (hard stop, crash), freeing their pages."""
        failed = list(self.requests.values())
        for request in failed:
            self.scheduler.finish(request, RequestStatus.FAILED, FinishReason.ERROR, error)
            self._forget(request)
        self._in_flight = None
        return failed

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    # -- what the manager's loop asks (it uses no part of the engine directly) ------------------

    @property
    def num_waiting(self) -> int:
        """Requests admitted and not scheduled yet (what `max_queue_size` bounds, with the inbox)."""
        return len(self.scheduler.waiting)

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def max_context(self) -> int:
        return self.shape.max_context

    @property
    def needs_warmup(self) -> bool:
        """Whether the first steps capture CUDA graphs or compile code (what a warmup does ahead)."""
        return self.runner.graphs is not None or self.runner.forward.enabled

    def free_cache(self) -> None:
        """Free the KV cache's memory for good (a destroyed manager)."""
        self.cache.k.clear()
        self.cache.v.clear()

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one forward pass; returns the requests that got a token or finished.

        With async batching the tokens returned are those of the previous call's forward pass,
        read after this call's pass was launched."""
        start = time.perf_counter()
        try:
            return self._step()
        except TensorParallelError:
            if self.parallel is not None:
                self.parallel.abort()
            raise
        finally:
            self.busy_seconds += time.perf_counter() - start

    def _step(self) -> list[Request]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.transfers:  # before any forward pass may write the pages they read
            self.host_pool.execute(plan.transfers)
            if self.host_pool.short_pulls:  # a node pool page changed since the plan was made
                self.scheduler.pulled_short(plan, self.host_pool.short_pulls)
        batch = plan.batch
        if not batch:
            updated = self._take_in_flight()
            if not updated and self.scheduler.has_work and not self.scheduler.running:
                raise RuntimeError("scheduler made no progress: a waiting request cannot fit the cache")
            return updated
        in_flight, self._in_flight = self._in_flight, None
        launch_async = (self.async_batching and all(s.request.plain_greedy for s in batch if s.sample)
                        and not any(s.request.computes_whole_prompt for s in batch))
        updated: list[Request] = []
        if in_flight is not None and not launch_async:
            # Synchronous: earlier tokens first (rows of requests that just stopped are dropped).
            updated = self._update(None, in_flight.results())
            batch = [s for s in batch if s.request.live]
            in_flight = None
            if not batch:
                return updated
        t1 = time.perf_counter()
        kwargs, sampled = self.runner.prepare(batch, in_flight)
        t2 = time.perf_counter()
        with model_sharing.engine_forward():  # the mask function builds no mask in this thread
            logits = self.runner.run(kwargs)
        t3 = time.perf_counter()
        requests = [s.request for s in sampled]
        num_rows = num_sampled_rows(sampled)
        # Logprobs only when a request of the step wants them: a greedy step without skips the exponentials.
        want_logprobs = any(r.return_logprobs for r in requests)
        if launch_async:  # this pass's greedy tokens stay on the device; the previous pass's are read
            launched = launch_greedy(logits, requests, want_logprobs)
            updated = self._update(None, in_flight.results()) if in_flight is not None else []
            self._update(plan, None)
            self._in_flight = launched
        else:
            if self.runner.prompt_chunks:  # their rows follow the sampled ones
                prompt_logprobs(logits[num_rows:], self.runner.prompt_chunks)
            if self.runner.pool_chunks:
                add_hidden_states(self.runner.hidden, self.runner.pool_chunks)
            if num_rows > len(requests):  # some requests verify proposed tokens
                result = sample_with_drafts(self.sampler, logits[:num_rows], requests, [s.draft for s in sampled],
                                            want_logprobs, [s.draft_probs for s in sampled])
            else:
                result = (self.sampler(logits[: len(requests)], requests, want_logprobs) if requests
                          else StepResult([]))
            updated += self._update(plan, result)
            updated += self._finish_pooled(batch)
        self.timings["schedule"] += t1 - t0
        self.timings["prepare"] += t2 - t1
        self.timings["forward"] += t3 - t2
        return updated

    def _update(self, plan: StepPlan | None, result: StepResult | None) -> list[Request]:
        """The step's bookkeeping is the scheduler's (`Scheduler.update`); the engine's part: the
        requests' sampler state takes their tokens first, and finished requests leave."""
        if result is not None:
            self._observe(result)
        updated = self.scheduler.update(plan, result)
        for request in updated:
            if not request.live:
                self._forget(request)
        return updated

    def _finish_pooled(self, batch: list) -> list[Request]:
        """Embedding requests whose prompt this step completed finish with their vectors."""
        done = completed([s.request for s in batch])
        for request in done:
            self.scheduler.finish(request, RequestStatus.FINISHED, FinishReason.POOLED)
            self._forget(request)
        return done

    def _observe(self, result: StepResult) -> None:
        """Each live request's grammar and penalties take its token; a request whose own state
        refuses it is at fault (it alone fails)."""
        for request, token in zip(result.requests, result.tokens):
            if not request.live:
                continue
            try:
                self.sampler.observe(request, token)
            except Exception as exc:  # the request's own state refused its token: it alone fails
                logger.exception("request %s: taking token %d raised", request.request_id, token)
                result.faults.append((request, _token_refused(request, exc)))

    def _take_in_flight(self) -> list[Request]:
        in_flight, self._in_flight = self._in_flight, None
        return self._update(None, in_flight.results()) if in_flight is not None else []

    def fail_request(self, request: Request, error: BaseException) -> None:
        """One request cannot go on (a fault of its own): it alone fails, its pages freed."""
        self.scheduler.fail(request, error)
        self._forget(request)

    def check_health(self) -> None:
        """Raise RuntimeError when the engine cannot run steps: its tensor-parallel group failed."""
        if self.parallel is not None:
            self.parallel.check_health()

    @property
    def num_steps(self) -> int:
        return self.scheduler.num_steps

    @property
    def generated_tokens(self) -> int:
        return self.scheduler.num_generated_tokens

    @property
    def prompt_tokens_computed(self) -> int:
        return self.scheduler.num_prompt_tokens

    def stats(self) -> dict[str, Any]:
        host = self.scheduler.host_pages
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "total_pages": self.block_manager.num_blocks,
            "free_pages": self.block_manager.num_free,
            "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "generated_tokens": self.generated_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "recomputes": self.scheduler.num_recomputes,
            "offloads": host.num_offloads if host else 0,
            "restores": host.num_restores if host else 0,
            "node_pool_hit_tokens": host.num_node_hit_tokens if host else 0,
            "steps": self.num_steps,
            "busy_seconds": self.busy_seconds,
            "spec_decode_num_drafts": self.scheduler.num_drafts,
            "spec_decode_num_draft_tokens": self.scheduler.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.scheduler.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.scheduler.accepted_per_position),
            **(self.lora.stats() if self.lora is not None else {}),
        }

