"""Bounds on grammar compilation (issue 26): a compile timeout, compiles that do not wait behind
one another, a bounded cache, a bounded nesting depth, and a constraint that min_tokens can never
satisfy refused at admission. The pool's scheduling is checked with stand-in compiles (events, no
xgrammar); the rest with the default model's tokenizer (49,152 tokens)."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time

import pytest
from transformers import GenerationConfig

import cbserve
from cbserve.errors import InvalidRequestError, QueueFullError
from cbserve.workers import grammar_bounds
from cbserve.workers.engine import EngineCore
from cbserve.workers.factory import build_engine
from cbserve.workers.structured import CompilePool, CompilerBusy, CompileTimeout, StructuredOutputs
from tests.support.tiny_models import random_prompts, tiny_model


def in_thread(fn, *args):
    """Run fn(*args) in a thread; the returned dict gets its "result" or "error" and "seconds"."""
    out: dict = {}

    def target():
        start = time.monotonic()
        try:
            out["result"] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc
        out["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    out["thread"] = thread
    return out


# ---- the pool, with stand-in compiles ----------------------------------------------------------


def blocked(release: threading.Event, calls: list, value):
    def fn():
        calls.append(value)
        release.wait(10)
        return value
    return fn


def test_a_slow_compile_holds_up_no_other() -> None:
    pool = CompilePool(threads=2, timeout_s=5)
    release, calls = threading.Event(), []
    slow = in_thread(pool.run, "slow", blocked(release, calls, "slow"))
    time.sleep(0.1)
    start = time.monotonic()
    assert pool.run("fast", lambda: "fast") == "fast"
    assert time.monotonic() - start < 1.0  # one lock for all compiles made this wait for the slow one
    release.set()
    slow["thread"].join(5)
    assert slow["result"] == "slow"


def test_a_compile_past_its_time_is_refused_and_frees_its_thread() -> None:
    pool = CompilePool(threads=1, timeout_s=0.3)
    release, calls = threading.Event(), []
    slow = in_thread(pool.run, "slow", blocked(release, calls, "slow"))
    time.sleep(0.05)
    start = time.monotonic()
    assert pool.run("next", lambda: "next") == "next"  # ran once the slow one overran its 0.3 s
    assert time.monotonic() - start < 1.5
    slow["thread"].join(2)
    assert isinstance(slow["error"], CompileTimeout) and 0.25 < slow["seconds"] < 1.5
    release.set()


def test_overrunning_compiles_are_capped_then_the_pool_is_busy() -> None:
    pool = CompilePool(threads=1, timeout_s=0.3)
    release, calls = threading.Event(), []
    first = in_thread(pool.run, "a", blocked(release, calls, "a"))
    time.sleep(0.5)  # "a" overran: its slot went free
    second = in_thread(pool.run, "b", blocked(release, calls, "b"))
    time.sleep(0.5)  # "b" overran too, but one overrunning compile is the cap: its slot stays held
    with pytest.raises(CompilerBusy) as err:
        pool.run("c", lambda: "c")
    assert isinstance(err.value, QueueFullError)  # an overload (HTTP 503), not the request's fault
    assert calls == ["a", "b"]
    release.set()
    for job in (first, second):
        job["thread"].join(2)
        assert isinstance(job["error"], CompileTimeout)
    assert pool.run("c", lambda: "c") == "c"  # both finished: their threads are back


def test_identical_compiles_share_one() -> None:
    pool = CompilePool(threads=2, timeout_s=5)
    release, calls = threading.Event(), []
    waiters = [in_thread(pool.run, "same", blocked(release, calls, "same")) for _ in range(5)]
    time.sleep(0.2)
    release.set()
    for w in waiters:
        w["thread"].join(5)
        assert w["result"] == "same"
    assert calls == ["same"]


def test_a_failed_compile_reaches_every_caller_and_frees_its_thread() -> None:
    pool = CompilePool(threads=1, timeout_s=5)

    def bad():
        raise ValueError("no such grammar")

    for _ in range(3):
        with pytest.raises(ValueError, match="no such grammar"):
            pool.run("bad", bad)
    assert pool.run("good", lambda: 1) == 1


def test_the_async_caller_gets_the_same_answers() -> None:
    pool = CompilePool(threads=1, timeout_s=0.2)
    release, calls = threading.Event(), []

    async def main():
        assert await pool.run_async("x", lambda: "x") == "x"
        with pytest.raises(CompileTimeout):
            await pool.run_async("slow", blocked(release, calls, "slow"))
        return await pool.run_async("after", lambda: "after")  # the overrun freed the one thread

    assert asyncio.run(main()) == "after"
    release.set()


# ---- nesting -----------------------------------------------------------------------------------


def test_nesting_depths_are_measured_as_written() -> None:
    assert grammar_bounds.json_depth({"a": [{"b": 1}]}) == 3
    assert grammar_bounds.json_depth('{"a": [{"b": "{{{[[["}]}') == 3  # brackets in strings do not count
    assert grammar_bounds.json_depth("[" * 100_000 + "]" * 100_000) == 100_000  # no recursion limit
    assert grammar_bounds.regex_depth(r"((a)\(b[(]c)") == 2
    assert grammar_bounds.ebnf_depth('root ::= ("(" ("a")) # ((((\nx ::= [(]') == 2


@functools.cache
def default_tokenizer():
    return cbserve.load_model(dtype="float32")[1]


def structured(**limits) -> StructuredOutputs:
    tok = default_tokenizer()
    return StructuredOutputs(tok, len(tok), [tok.eos_token_id], cbserve.ContinuousBatchingConfig(**limits))


def nested_arrays(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


@pytest.mark.default_model
@pytest.mark.parametrize("kind, spec, depth", [
    ("json_schema", nested_arrays(1000), 1001),  # xgrammar did not convert it within 60 s
    ("json_schema", json.loads(nested_arrays(200)), 201),  # parsed: the same bound
    ("regex", "(" * 900 + "a" + ")" * 900, 900),
    ("grammar", 'root ::= ' + "(" * 900 + '"a"' + ")" * 900, 900),
])
def test_a_deeply_nested_constraint_is_refused_before_compiling(kind: str, spec, depth: int) -> None:
    compiler = structured()
    start = time.monotonic()
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(kind, spec, "guided_x")
    assert time.monotonic() - start < 1.0
    assert err.value.field == "guided_x"
    assert f"{depth} levels deep; at most 64 (grammar_max_nesting)" in err.value.message


@pytest.mark.default_model
def test_nesting_within_the_bound_compiles() -> None:
    compiler = structured(grammar_max_nesting=8)
    compiler.compile("json_schema", nested_arrays(7), "guided_json")  # depth 8
    compiler.compile("regex", "((((a))))", "guided_regex")
    with pytest.raises(InvalidRequestError, match="9 levels deep; at most 8"):
        compiler.compile("json_schema", nested_arrays(8), "guided_json")


# ---- timeout and cache, with xgrammar ----------------------------------------------------------


@pytest.mark.default_model
def test_a_compile_past_the_timeout_is_a_400_and_others_go_on() -> None:
    # Arrays nested 250 deep (the nesting bound raised for it): seconds to convert and compile.
    compiler = structured(grammar_compile_timeout_s=0.2, grammar_compile_threads=1, grammar_max_nesting=300)
    slow = in_thread(compiler.compile, "json_schema", nested_arrays(250), "guided_json")
    time.sleep(0.05)
    start = time.monotonic()
    compiler.compile("choice", ["left", "right"], "guided_choice")  # the slow compile's thread was freed
    assert time.monotonic() - start < 1.0
    slow["thread"].join(5)
    err = slow["error"]
    assert isinstance(err, InvalidRequestError) and err.field == "guided_json"
    assert "longer than 0.2s to compile (grammar_compile_timeout_s)" in err.message


@pytest.mark.default_model
def test_the_compile_cache_is_bounded() -> None:
    limit = 3 << 20
    compiler = structured(grammar_cache_limit_bytes=limit)
    assert compiler._compiler.cache_limit_bytes == limit
    for n in range(40):
        compiler.compile("regex", f"[a-z]{{{n + 1},{n + 60}}}x", "guided_regex")
    # xgrammar "may slightly exceed" it (3.47 MB seen for 3 MiB); unbounded, these 40 took 39.5 MB
    assert compiler._compiler.get_cache_size_bytes() <= limit * 1.5


# ---- min_tokens against the constraint ---------------------------------------------------------


@pytest.mark.default_model
@pytest.mark.parametrize("kind, spec, most", [
    ("choice", ["yes", "no"], 3), ("choice", ["oui", "déjà"], 6), ("regex", "(yes|no)", 3),
    ("regex", "[0-9]{3}-[a-z]{2}", 6), ("json_schema", {"type": "boolean"}, 5), ("json_schema", {"enum": ["a", "bc"]}, 4),
    ("grammar", 'root ::= "(" [a-z]{1,3} ("," [a-z]{1,3}){0,2} ")"', 13),
    ("regex", "[a-z]+", None), ("json_object", None, None), ("grammar", 'root ::= "a" root | "b"', None),
    ("json_schema", {"type": "string", "pattern": "^[a-c]{2}$"}, None),  # a Regex macro: not read, so unknown
])
def test_the_longest_output_is_a_bound(kind: str, spec, most) -> None:
    import xgrammar as xgr

    grammar = structured().compile(kind, spec)
    assert grammar.max_output_bytes == most
    longest = {"choice": lambda: max(spec, key=lambda c: len(c.encode())), "regex": lambda: "123-ab",
               "json_schema": lambda: "false" if spec.get("type") == "boolean" else '"bc"',
               "grammar": lambda: "(abc,abc,abc)"}
    if most is not None and not (kind == "regex" and spec == "(yes|no)"):
        matcher = xgr.GrammarMatcher(grammar.compiled)  # an output of exactly `most` bytes exists: it is tight
        text = longest[kind]()
        assert len(text.encode()) == most and matcher.accept_string(text) and matcher.is_completed()


def engine(min_length: int = 0) -> EngineCore:
    tok = default_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok))
    gc = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id, min_length=min_length)
    return build_engine(model, gc, cbserve.ContinuousBatchingConfig(page_size=16, num_blocks=64,
                                                                     per_request_processors=True))


def sampling(core: EngineCore, **options):
    from cbserve.workers import validation

    return validation.sampling(core.default_sampling(), True, core.shape.vocab_size, **options)


@pytest.mark.default_model
@pytest.mark.parametrize("kind, spec, field, min_tokens", [
    ("choice", ["yes"], "guided_choice", 8), ("choice", ["yes", "no"], "guided_choice", 4),
    ("regex", "(yes|no)", "guided_regex", 4), ("json_schema", {"type": "boolean"}, "guided_json", 6),
])
def test_a_constraint_min_tokens_cannot_reach_is_refused_naming_both(kind, spec, field, min_tokens) -> None:
    core = engine()
    grammar = structured().compile(kind, spec, field)
    prompt = random_prompts([5], vocab=core.shape.vocab_size)[0]
    try:
        with pytest.raises(InvalidRequestError) as err:
            core.make_request(prompt, "r", sampling=sampling(core, min_tokens=min_tokens), grammar=grammar)
    finally:
        core.release_model()
    assert err.value.field == "min_tokens"
    assert f"min_tokens ({min_tokens}) and {field} cannot both hold" in err.value.message


@pytest.mark.default_model
@pytest.mark.parametrize("kind, spec, min_tokens", [
    ("choice", ["yes", "abcdefgh"], 8), ("choice", ["yes"], 3), ("regex", "[a-z]+", 50),
    ("json_schema", {"type": "boolean"}, 5), ("grammar", 'root ::= "a" root | "b"', 100), ("json_object", None, 30),
])
def test_a_feasible_constraint_and_min_tokens_are_admitted(kind, spec, min_tokens) -> None:
    core = engine()
    grammar = structured().compile(kind, spec)
    prompt = random_prompts([5], vocab=core.shape.vocab_size)[0]
    try:
        request = core.make_request(prompt, "r", sampling=sampling(core, min_tokens=min_tokens), grammar=grammar)
    finally:
        core.release_model()
    assert request.sampling.min_new_tokens == min_tokens


@pytest.mark.default_model
def test_min_length_counts_and_an_unbarred_stop_token_admits() -> None:
    grammar = structured().compile("choice", ["yes"], "guided_choice")
    core = engine(min_length=5 + 4)  # the generation config's min_length: 4 new tokens for a 5-token prompt
    prompt = random_prompts([5], vocab=core.shape.vocab_size)[0]
    try:
        with pytest.raises(InvalidRequestError, match=r"min_tokens \(4\) and guided_choice"):
            core.make_request(prompt, "a", grammar=grammar)
        # A request whose EOS is another token: min_tokens does not bar the grammar's stop token,
        # which ends the request (grammar_done) however short: feasible.
        core.make_request(prompt, "b", eos_token_id=0, grammar=grammar)
    finally:
        core.release_model()


def random_regex(rng, depth: int = 0) -> str:
    r = rng.random()
    if depth > 2 or r < 0.3:
        atom = rng.choice(["a", "b", "é", "[ab]", "[aé]", "[^b]", "."])
    elif r < 0.6:
        atom = "(" + "|".join(random_regex(rng, depth + 1) for _ in range(rng.randint(1, 3))) + ")"
    else:
        atom = "(" + random_regex(rng, depth + 1) + random_regex(rng, depth + 1) + ")"
    q = rng.random()
    return atom + ("?" if q < 0.15 else "*" if q < 0.2 else "+" if q < 0.25
                   else f"{{{rng.randint(0, 2)},{rng.randint(2, 3)}}}" if q < 0.35 else "")


@pytest.mark.default_model
def test_the_bound_never_undercounts_what_the_grammar_accepts() -> None:
    """Random regexes over a, b and é: no string xgrammar's own matcher accepts (every string of
    up to 5 characters tried) is longer than the bound read from the compiled grammar."""
    import itertools
    import random

    import xgrammar as xgr

    rng, compiler = random.Random(0), structured()
    strings = ["".join(p) for n in range(6) for p in itertools.product("abé", repeat=n)]
    bounded = 0
    for _ in range(80):
        pattern = random_regex(rng)
        try:
            grammar = compiler.compile("regex", pattern)
        except InvalidRequestError:  # e.g. two repetition modifiers in a row
            continue
        most = grammar.max_output_bytes
        if most is None:
            continue
        bounded += 1
        for text in strings:
            matcher = xgr.GrammarMatcher(grammar.compiled, terminate_without_stop_token=True)
            if matcher.accept_string(text) and matcher.is_completed():
                assert len(text.encode()) <= most, (pattern, text, most)
    assert bounded >= 20
