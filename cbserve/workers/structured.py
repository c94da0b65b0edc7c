"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a regex,
a choice list or a grammar, by a per-step token bitmask from xgrammar.

Why xgrammar: on the default model's 49,152-token vocabulary (2-core EPYC), filling the mask and
accepting a token took 9 us per token against 130-240 us for llguidance, and compiling a small
JSON schema 9-50 ms (llguidance 1-9 ms, outlines-core 60 ms for its index); its compiler caches
grammars by their source, and it is what vLLM and SGLang use by default (bench: README).

Grammars are compiled where a request is submitted (the caller's thread, not the engine's loop),
each on a thread of a bounded `CompilePool`, cached by xgrammar up to `grammar_cache_limit_bytes`;
each request gets its own matcher, advanced by every token it samples. One `GrammarCompiler` serves
every thread: its cache is xgrammar's thread-safe LRU (its own tests compile from 100 threads at
once), and a compile releases the GIL (a Python thread ticked 863 times in a 0.95 s compile).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from cbserve.config import ContinuousBatchingConfig
from cbserve.errors import InvalidRequestError, QueueFullError
from cbserve.workers import grammar_bounds

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled constraint; `kind` and `source` say what it was compiled from, `field` which
    request field gave it; `choices`: a choice list's entries."""

    kind: str
    source: str
    compiled: Any  # xgrammar.CompiledGrammar
    field: str = "response_format"
    choices: tuple[str, ...] = ()

    @functools.cached_property
    def max_output_bytes(self) -> int | None:
        """The most bytes any output it allows can take; None: unbounded or not certain."""
        if self.kind == "choice":
            return max(len(c.encode("utf-8")) for c in self.choices)
        return grammar_bounds.max_output_bytes(str(self.compiled.grammar))

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokens that end it (the model's EOS ids it was compiled with)."""
        return list(self.compiled.tokenizer_info.stop_token_ids)


# ---- the compile pool --------------------------------------------------------------------------


class CompileTimeout(Exception):
    """A compile ran past the pool's timeout."""


class CompilerBusy(QueueFullError):
    """No compile thread came free within the timeout: an overload, not a bad request."""

    def __init__(self, threads: int, timeout_s: float) -> None:
        queue.Full.__init__(self, f"all {threads} grammar compile threads stayed busy for "
                                  f"grammar_compile_timeout_s={timeout_s:g}s; retry later")
        self.max_queue_size, self.waiting = threads, threads


@dataclass(eq=False)
class _Job:
    fn: Callable[[], Any]
    deadline: float  # the latest any of its callers waits for it to start
    started: Future = field(default_factory=Future)  # its start time (time.monotonic)
    done: Future = field(default_factory=Future)
    holds_slot: bool = True


class CompilePool:
    """Compiles on their own threads, at most `threads` at once within their time; callers of an
    identical compile (`key`) share it. xgrammar cannot stop a compile: one past `timeout_s` is left
    to finish but frees its slot, for up to `threads` such at once, so one slow compile delays no
    other and at most 2 x `threads` compile threads ever run."""

    def __init__(self, threads: int, timeout_s: float) -> None:
        self.threads, self.timeout_s = threads, timeout_s
        self._lock = threading.Lock()
        self._jobs: dict[Hashable, _Job] = {}  # queued or running
        self._queue: deque[Hashable] = deque()
        self._free = threads
        self._overdue = 0

    def run(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """`fn()`'s result; raises CompilerBusy (no thread came free in time) or CompileTimeout."""
        arrival = time.monotonic()
        job = self._submit(key, fn)
        try:
            start = job.started.result(timeout=max(0.0, arrival + self.timeout_s - time.monotonic()))
        except FutureTimeout:
            raise CompilerBusy(self.threads, self.timeout_s) from None
        try:
            return job.done.result(timeout=max(0.0, start + self.timeout_s - time.monotonic()))
        except FutureTimeout:
            raise CompileTimeout() from None

    async def run_async(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """`run` for an event loop: waits without holding a thread."""
        arrival = time.monotonic()
        job = self._submit(key, fn)
        try:  # shielded: a caller giving up must not cancel the compile others share
            start = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.started)),
                                           max(0.0, arrival + self.timeout_s - time.monotonic()))
        except TimeoutError:
            raise CompilerBusy(self.threads, self.timeout_s) from None
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.done)),
                                          max(0.0, start + self.timeout_s - time.monotonic()))
        except TimeoutError:
            raise CompileTimeout() from None

    def _submit(self, key: Hashable, fn: Callable[[], Any]) -> _Job:
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = _Job(fn, deadline)
                self._queue.append(key)
            else:
                job.deadline = max(job.deadline, deadline)
            starting, expired = self._dispatch()
        self._start(starting, expired)
        return job

    def _dispatch(self) -> tuple[list[tuple[Hashable, _Job]], list[_Job]]:
        """Under the lock: the queued jobs that take the free slots, and those nobody waits for."""
        starting, expired, now = [], [], time.monotonic()
        while self._queue and self._free > 0:
            key = self._queue.popleft()
            job = self._jobs[key]
            if job.deadline < now:
                del self._jobs[key]
                expired.append(job)
                continue
            self._free -= 1
            starting.append((key, job))
        return starting, expired

    def _start(self, starting: list[tuple[Hashable, _Job]], expired: list[_Job]) -> None:
        for job in expired:
            busy = CompilerBusy(self.threads, self.timeout_s)
            job.started.set_exception(busy)
            job.done.set_exception(busy)
        for key, job in starting:
            job.started.set_result(time.monotonic())
            timer = threading.Timer(self.timeout_s, self._overrun, (key, job))
            timer.daemon = True
            timer.start()
            threading.Thread(target=self._work, args=(key, job, timer), name="grammar-compile", daemon=True).start()

    def _work(self, key: Hashable, job: _Job, timer: threading.Timer) -> None:
        result: Any = None
        error: BaseException | None = RuntimeError("the grammar compile thread was interrupted")
        try:
            result, error = job.fn(), None
        except Exception as exc:  # noqa: BLE001 - handed to every caller, who refuses the request
            error = exc
        finally:  # the slot comes back whatever happened
            timer.cancel()
            with self._lock:
                del self._jobs[key]
                if job.holds_slot:
                    self._free += 1
                else:
                    self._overdue -= 1
                starting, expired = self._dispatch()
            if error is None:
                job.done.set_result(result)
            else:
                job.done.set_exception(error)
            self._start(starting, expired)

    def _overrun(self, key: Hashable, job: _Job) -> None:
        """The job ran past its time: its slot goes to the next compile, unless too many overran."""
        with self._lock:
            if self._jobs.get(key) is not job or self._overdue >= self.threads:
                return
            job.holds_slot = False
            self._overdue += 1
            self._free += 1
            starting, expired = self._dispatch()
        self._start(starting, expired)


# ---- compiling ---------------------------------------------------------------------------------


class StructuredOutputs:
    """Compiles constraints for one model's tokenizer. `vocab_size`: the model's logits width
    (may exceed the tokenizer's); `stop_token_ids`: the model's EOS ids, which end a grammar;
    `config`: the `grammar_*` bounds (the defaults when None)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None = None,
                 config: ContinuousBatchingConfig | None = None) -> None:
        import xgrammar as xgr

        config = config or ContinuousBatchingConfig()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=config.grammar_cache_limit_bytes)
        self._pool = CompilePool(config.grammar_compile_threads, config.grammar_compile_timeout_s)
        self.max_nesting = config.grammar_max_nesting

    def compile(self, kind: str, spec: Any, field: str = "response_format") -> Grammar:
        """Raises InvalidRequestError naming `field` when the spec is not a valid constraint, nests
        too deeply or compiles for too long; CompilerBusy when no compile thread comes free."""
        source = self.prepare(kind, spec, field)
        with self._refusals(kind, field):
            compiled = self._pool.run((kind, source), functools.partial(self._compile, kind, source))
        return Grammar(kind, source, compiled, field, tuple(spec) if kind == "choice" else ())

    async def compile_async(self, kind: str, spec: Any, field: str = "response_format") -> Grammar:
        """`compile` for an event loop: the checks in a worker thread, the compile awaited."""
        source = await asyncio.to_thread(self.prepare, kind, spec, field)
        with self._refusals(kind, field):
            compiled = await self._pool.run_async((kind, source), functools.partial(self._compile, kind, source))
        return Grammar(kind, source, compiled, field, tuple(spec) if kind == "choice" else ())

    def prepare(self, kind: str, spec: Any, field: str) -> str:
        """The source to compile, after the checks that need no compile (kind, form, nesting)."""
        if kind not in KINDS:
            raise InvalidRequestError(field, f"{field}: unknown constraint kind {kind!r}; one of {list(KINDS)}")
        depth = grammar_bounds.nesting(kind, spec)  # before any other work on a deep spec
        if depth > self.max_nesting:
            raise InvalidRequestError(field, f"{field}: the {kind} nests {depth} levels deep; at most "
                                      f"{self.max_nesting} (grammar_max_nesting)")
        try:
            return self._source(kind, spec)
        except ValueError as exc:
            raise InvalidRequestError(field, f"{field}: the {kind} could not be compiled: {exc}") from exc

    @contextlib.contextmanager
    def _refusals(self, kind: str, field: str) -> Iterator[None]:
        try:
            yield
        except (InvalidRequestError, QueueFullError):
            raise
        except CompileTimeout:
            raise InvalidRequestError(field, f"{field}: the {kind} took longer than {self._pool.timeout_s:g}s to "
                                      "compile (grammar_compile_timeout_s); simplify it") from None
        except Exception as exc:  # xgrammar's parse errors: a bad schema, regex or grammar
            raise InvalidRequestError(field, f"{field}: the {kind} could not be compiled: {exc}") from exc

    @staticmethod
    def _source(kind: str, spec: Any) -> str:
        if kind == "json_object":
            return ""
        if kind == "json_schema":
            return spec if isinstance(spec, str) else json.dumps(spec)  # keys in order: the output writes them so
        if kind == "choice":
            if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) for c in spec):
                raise ValueError("a choice must be a non-empty list of strings")
            return "(" + "|".join(re.escape(c) for c in spec) + ")"
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"a {kind} must be a non-empty string")
        return spec

    def _compile(self, kind: str, source: str) -> Any:
        if kind == "json_object":  # any object; no free whitespace, which small models repeat forever
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "json_schema":
            return self._compiler.compile_json_schema(source, any_whitespace=False)
        if kind in ("regex", "choice"):
            return self._compiler.compile_regex(source)
        return self._compiler.compile_grammar(source)


class GrammarState:
    """One request's matcher: the bitmask of tokens allowed next, advanced token by token."""

    def __init__(self, grammar: Grammar) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(grammar.compiled)

    def allowed(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token} that its own mask allowed")


def check_grammar_accepts(grammar: Grammar, tokens: list[int]) -> None:
    """A continued request's output so far (`resume_tokens`) must be one its grammar allows."""
    state = GrammarState(grammar)
    for i, token in enumerate(tokens):
        if state.matcher.is_terminated() or not state.matcher.accept_token(token):
            raise InvalidRequestError("resume_tokens", f"resume_tokens[{i}]: token {token} is not allowed there by "
                                      f"the request's {grammar.field}")


def apply_masks(logits: torch.Tensor, states: dict[int, GrammarState]) -> None:
    """Tokens outside each constrained row's grammar get -inf (`states`: row -> its state)."""
    import xgrammar as xgr

    rows = sorted(states)
    bitmask = xgr.allocate_token_bitmask(len(logits), logits.shape[-1])
    for row in rows:
        states[row].allowed(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)



def mask_proposal_rows(rows: torch.Tensor, matcher: Any, draft: list[int]) -> None:
    """A speculating request's rows (its last token's, then each proposal's), masked in place, each
    by the grammar as it stands after the proposals before the row: the matcher takes the proposals
    while it allows them, each row's mask filled on the way, and is rolled back to where it began.
    Rows after a proposal the grammar refuses stay as they are: that proposal's own row excludes
    it, so verification stops there; so do rows after an allowed stop token (the request ends)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), rows.shape[-1])
    matcher.fill_next_token_bitmask(bitmask, 0)
    taken = 0  # proposals the matcher took; rows 0..taken are masked
    while taken < len(draft) and not matcher.is_terminated() and matcher.accept_token(draft[taken]):
        taken += 1
        if matcher.is_terminated():  # a stop token: no row after it is used
            taken -= 1
            matcher.rollback(1)
            break
        matcher.fill_next_token_bitmask(bitmask, taken)
    if taken:
        matcher.rollback(taken)
    xgr.apply_token_bitmask_inplace(rows, bitmask, vocab_size=rows.shape[-1], indices=list(range(taken + 1)))
