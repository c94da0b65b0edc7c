"""The per-node KV pool (issue 18): engines of one node share KV pages through one bounded host
pool in shared memory, keyed by prefix hash chains.

- Two engines (in one process, and in two processes) and a 1,000-token system prompt: the
  second engine pulls the prompt's pages from the pool instead of computing them; its computed
  prompt tokens drop by as many; every output equals `generate()`'s.
- Never a wrong page: a corrupted page, pages of another model, a pool whose owner died, all
  read as misses (the engine recomputes, outputs unchanged).
- The pool itself: least recently used replacement, slots a dead writer left half written are
  reclaimed, token and checksum verification.
- A request preempted without room in the engine's host pool leaves its pages to the pool and
  pulls them back on readmission.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

import cbserve
from cbserve.workers.engine import EngineCore
from cbserve.workers.factory import build_engine
from cbserve.workers.kv import node_pool
from cbserve.workers.kv.node_pool import NodeKVPool, chain_keys
from tests.support.exactness import run_engine
from tests.support.tiny_models import random_prompts, reference_generate, tiny_model

PAGE = 16
SYSTEM = 1000
MAX_NEW = 8


@pytest.fixture
def pool_name():
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    owner = NodeKVPool.create(name, 8 << 20)
    yield name
    owner.close()
    assert not node_pool.pool_path(name).exists()


def config(name: str | None, **overrides) -> cbserve.ContinuousBatchingConfig:
    cfg = {"page_size": PAGE, "num_blocks": 160, "max_batch_tokens": 256, "return_logprobs": True,
           "cpu_offload_space": 0.002, "node_kv_pool": name}
    cfg.update(overrides)
    return cbserve.ContinuousBatchingConfig(**cfg)


def prompts() -> list[list[int]]:
    system = random_prompts([SYSTEM], seed=11)[0]
    return [system + tail for tail in random_prompts([9, 5], seed=12)]


def run(model, prompt: list[int], cfg) -> tuple[list[int], list[float], EngineCore]:
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    engine = build_engine(model, gc, cfg)
    try:
        request = engine.make_request(prompt, "req")
        engine.add_request(request)
        while engine.has_work:
            engine.step()
    finally:
        engine.release_model()
    return request.generated, request.logprobs, engine


def assert_reference(model, prompt, tokens, logprobs) -> None:
    ref_tokens, ref_logprobs = reference_generate(model, prompt, MAX_NEW)
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-6)


def test_second_engine_pulls_the_shared_system_prompt(pool_name: str) -> None:
    model = tiny_model("llama")
    a, b = prompts()
    tokens_a, logprobs_a, engine_a = run(model, a, config(pool_name))
    assert engine_a.stats()["prompt_tokens_computed"] == len(a)
    assert engine_a.node_pool.num_published == len(a) // PAGE
    tokens_b, logprobs_b, engine_b = run(model, b, config(pool_name))
    shared = SYSTEM // PAGE * PAGE  # the full pages of the system prompt: 992 tokens
    assert engine_b.scheduler.host_pages.num_node_hit_tokens == shared
    assert engine_b.stats()["prompt_tokens_computed"] == len(b) - shared
    assert_reference(model, a, tokens_a, logprobs_a)
    assert_reference(model, b, tokens_b, logprobs_b)
    # Without the pool, the second engine computes the whole prompt.
    _, _, alone = run(model, b, config(None))
    assert alone.stats()["prompt_tokens_computed"] == len(b)


def _engine_in_another_process(name: str, prompt: list[int], queue) -> None:
    try:
        tokens, logprobs, engine = run(tiny_model("llama"), prompt, config(name))
        queue.put((tokens, logprobs, engine.stats()["prompt_tokens_computed"],
                   engine.scheduler.host_pages.num_node_hit_tokens))
    except BaseException as error:  # noqa: BLE001 - reported to the test
        queue.put(repr(error))


def test_engines_in_two_processes_share_the_pool(pool_name: str) -> None:
    model = tiny_model("llama")
    a, b = prompts()
    run(model, a, config(pool_name))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_engine_in_another_process, args=(pool_name, b, queue))
    proc.start()
    result = queue.get(timeout=120)
    proc.join(30)
    assert not isinstance(result, str), result
    tokens, logprobs, computed, hits = result
    assert hits == SYSTEM // PAGE * PAGE and computed == len(b) - hits
    assert_reference(model, b, tokens, logprobs)


def test_a_corrupted_page_is_a_miss(pool_name: str) -> None:
    model = tiny_model("llama")
    a, b = prompts()
    run(model, a, config(pool_name))
    pool = NodeKVPool.attach(pool_name)
    salt = pool.header[node_pool.H_FINGERPRINT].item()
    keys = chain_keys(a, PAGE, 10, salt)
    slot = int(((pool.meta[:, node_pool.KEY] == keys[9]) & (pool.meta[:, node_pool.PARENT] == keys[8])).nonzero()[0, 0])
    pool.data[slot, 100] ^= 0xFF  # one flipped byte in page 9
    tokens, logprobs, engine = run(model, b, config(pool_name))
    assert engine.scheduler.host_pages.num_node_hit_tokens == 9 * PAGE  # pages 0-8, then the miss
    assert engine.stats()["prompt_tokens_computed"] == len(b) - 9 * PAGE
    assert_reference(model, b, tokens, logprobs)
    pool.detach()


def test_another_models_pages_are_never_used(pool_name: str) -> None:
    a, b = prompts()
    run(tiny_model("llama"), a, config(pool_name))
    other = tiny_model("llama", seed=1)  # same shapes, other weights
    tokens, logprobs, engine = run(other, b, config(pool_name))
    assert engine.node_pool is None  # the pool is formatted for the first model's pages
    assert engine.stats()["prompt_tokens_computed"] == len(b)
    assert_reference(other, b, tokens, logprobs)


def _own_a_pool(name: str, ready) -> None:
    NodeKVPool.create(name, 8 << 20)
    ready.set()
    signal.pause()


def test_a_dead_owner_means_misses() -> None:
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    owner = ctx.Process(target=_own_a_pool, args=(name, ready))
    owner.start()
    try:
        assert ready.wait(60)
        model = tiny_model("llama")
        a, b = prompts()
        _, _, engine_a = run(model, a, config(name))
        assert engine_a.node_pool.num_published > 0
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(30)
        tokens, logprobs, engine_b = run(model, b, config(name))
        assert engine_b.scheduler.host_pages.num_node_hit_tokens == 0
        assert engine_b.stats()["prompt_tokens_computed"] == len(b)
        assert_reference(model, b, tokens, logprobs)
        # A new owner replaces the dead one's file.
        NodeKVPool.create(name, 1 << 20).close()
    finally:
        if owner.is_alive():
            owner.kill()
        node_pool.pool_path(name).unlink(missing_ok=True)


def test_preempted_pages_go_to_the_pool(pool_name: str) -> None:
    """A cache too small for the batch and a host pool of two pages: preempted requests leave
    their full pages (prompt and generated tokens) to the node pool; an engine given one of those
    requests' tokens as its prompt pulls them, and still generates what `generate()` does."""
    model = tiny_model("qwen3")
    prompt_list = random_prompts([1, 7, 33, 64, 100, 150, 300])
    cfg = config(pool_name, num_blocks=24, max_batch_tokens=64,
                 cpu_offload_space=2 * PAGE * 2 * 2 * 16 * 2 * 8 / 2**30)  # two pages: mostly no room
    exported: list[list[int]] = []

    def record_exports(engine: EngineCore) -> None:
        execute = engine.host_pool.execute
        engine.host_pool.execute = lambda transfers: (
            exported.extend(list(t.tokens) for t in transfers if t.kind == "export"), execute(transfers))

    requests, engine = run_engine(model, prompt_list, cfg, 10, record_exports)
    hp = engine.scheduler.host_pages
    assert hp.num_exports > 0 and hp.num_free == hp.num_blocks
    for request, prompt in zip(requests, prompt_list):
        ref_tokens, ref_logprobs = reference_generate(model, prompt, 10)
        assert request.generated == ref_tokens, request.request_id
        assert request.logprobs == pytest.approx(ref_logprobs, abs=1e-6)
    longest = max(exported, key=len)  # whole pages of some request's prompt and generated tokens
    tokens, logprobs, reader = run(model, longest + [5], config(pool_name))
    assert reader.scheduler.host_pages.num_node_hit_tokens == len(longest)
    assert_reference(model, longest + [5], tokens, logprobs)


def test_the_pool_folder_can_be_chosen(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(node_pool.DIRECTORY_ENV, str(tmp_path))
    owner = NodeKVPool.create("chosen", 1 << 20)
    assert owner.path == tmp_path / "cbserve-kv-chosen" and NodeKVPool.attach("chosen").alive()
    owner.close()
    with pytest.raises(ValueError, match="file name"):
        node_pool.pool_path("a/b")


def test_pool_replacement_and_verification(tmp_path) -> None:
    capacity = node_pool.HEADER_SLOTS * 8 + node_pool.ALIGN + 3 * (node_pool.FIELDS * 8 + 4 * 4 + 64)
    pool = NodeKVPool.create("unit", capacity, directory=tmp_path)
    assert pool.format(4, 64, 77)
    assert pool.num_slots == 3
    assert not pool.format(4, 64, 78)  # other pages: refused
    pages = {k: torch.full((64,), k, dtype=torch.uint8) for k in range(1, 5)}
    for k in (1, 2, 3):
        assert pool.store(k, 0, [k] * 4, pages[k])
    assert not pool.store(1, 0, [1] * 4, pages[1])  # held already
    assert torch.equal(pool.fetch(1, 0, [1] * 4), pages[1])  # page 1 is now the most recently used
    assert pool.fetch(1, 0, [1, 1, 1, 2]) is None  # other tokens
    assert pool.fetch(1, 5, [1] * 4) is None  # other parent
    assert pool.store(4, 0, [4] * 4, pages[4])  # replaces the least recently used: 2
    assert pool.fetch(2, 0, [2] * 4) is None and pool.fetch(3, 0, [3] * 4) is not None
    # A slot a dead writer left half written is taken before any page that is READY.
    slot = int((pool.meta[:, node_pool.KEY] == 1).nonzero()[0, 0])
    pool.meta[slot, node_pool.STATE], pool.meta[slot, node_pool.WRITER] = node_pool.WRITING, 2**22 + 12345
    assert pool.store(5, 0, [5] * 4, torch.zeros(64, dtype=torch.uint8))
    assert pool.fetch(3, 0, [3] * 4) is not None and pool.fetch(4, 0, [4] * 4) is not None
    assert pool.stats() == {"slots": 3, "ready": 3}
    pool.close()


def test_config_refuses_a_node_pool_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="node_kv_pool needs cpu_offload_space"):
        cbserve.ContinuousBatchingConfig(node_kv_pool="x")
    with pytest.raises(ValueError, match="node_kv_pool works with tp_size=1 only"):
        cbserve.ContinuousBatchingConfig(node_kv_pool="x", cpu_offload_space=1.0, tp_size=2)
    with pytest.raises(ValueError, match="node_kv_pool"):
        cbserve.ContinuousBatchingConfig(node_kv_pool="", cpu_offload_space=1.0)
    with pytest.raises(FileNotFoundError, match="no node KV pool named 'absent-pool'"):
        run(tiny_model("llama"), [1, 2, 3], config("absent-pool"))


@pytest.mark.parametrize("arch, overrides", [("llama", {"allow_block_sharing": False}), ("gemma2", {})])
def test_an_engine_that_cannot_use_the_pool_refuses_it(pool_name: str, arch: str, overrides: dict) -> None:
    """Without prefix caching (turned off, or sliding-window layers) the pool would be ignored."""
    model = tiny_model(arch)
    own = model.config._attn_implementation
    with pytest.raises(ValueError, match="node_kv_pool .* needs prefix caching"):
        build_engine(model, GenerationConfig(max_new_tokens=2), config(pool_name, **overrides))
    assert model.config._attn_implementation == own  # refused before the engine took the model's attention


# -- the pool file: private, reserved, cleaned after a crash (issue 26) -----------------------


def test_the_pool_file_is_private_whatever_the_umask(tmp_path) -> None:
    old = os.umask(0)  # the worst umask: without an explicit mode the file would be 0666
    try:
        owner = NodeKVPool.create("private", 1 << 20, directory=tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(owner.path).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["cbserve-kv-private"]  # no temporary file left
    os.chmod(owner.path, 0o644)  # readable by every local user: engines refuse to put pages in it
    with pytest.raises(PermissionError, match="not a private node KV pool file"):
        NodeKVPool.attach("private", directory=tmp_path)
    os.chmod(owner.path, 0o600)
    planted = tmp_path / "cbserve-kv-planted"
    planted.symlink_to(owner.path)  # a link is never followed
    with pytest.raises(OSError):
        NodeKVPool.attach("planted", directory=tmp_path)
    owner.close()


@pytest.mark.skipif(not os.path.ismount("/dev/shm"), reason="needs /dev/shm mounted (tmpfs)")
def test_the_pool_memory_is_reserved_up_front() -> None:
    """A sparse file on tmpfs takes memory only as pages are written: past the free space an
    engine gets SIGBUS. The pool reserves it all at creation, and a pool larger than /dev/shm is
    refused there."""
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    owner = NodeKVPool.create(name, 8 << 20, directory="/dev/shm")
    try:
        assert os.stat(owner.path).st_blocks * 512 >= 8 << 20
    finally:
        owner.close()
    vfs = os.statvfs("/dev/shm")
    too_big = vfs.f_blocks * vfs.f_frsize + (1 << 30)  # tmpfs refuses it before reserving any of it
    with pytest.raises(OSError, match=r"cannot reserve its \d+ bytes in /dev/shm"):
        NodeKVPool.create(name, too_big, directory="/dev/shm")
    assert not list(Path("/dev/shm").glob(f"cbserve-kv-{name}*"))  # neither the pool nor its temporary file


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_files_of_dead_owners_are_removed_when_a_pool_is_created(tmp_path) -> None:
    live = NodeKVPool.create("live", 1 << 20, directory=tmp_path)
    crashed = NodeKVPool.create("crashed", 1 << 20, directory=tmp_path)
    crashed.header[node_pool.H_OWNER_PID] = _dead_pid()  # as if its owner was SIGKILLed
    crashed.detach()  # no close(): a crash leaves the file behind
    half_made = tmp_path / f"cbserve-kv-other.{_dead_pid()}.tmp"  # its creator died before the rename
    half_made.write_bytes(b"\0" * 4096)
    foreign = tmp_path / "cbserve-kv-notapool"  # not a pool file: left alone
    foreign.write_bytes(b"x" * 4096)
    new = NodeKVPool.create("new", 1 << 20, directory=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cbserve-kv-live", "cbserve-kv-new", "cbserve-kv-notapool"]
    assert live.alive() and NodeKVPool.attach("live", directory=tmp_path).alive()
    for pool in (live, new):
        pool.close()
