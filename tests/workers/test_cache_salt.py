"""`cache_salt` (issue 26; vLLM's name and semantics): a per-request string mixed into the hash of
the request's first page, so that its prefix pages are shared only with requests of the same salt,
never with requests of another salt or of none, in the engine's prefix cache and in the per-node
KV pool. Tokens are the same either way (a miss is recomputed).

Through every front: the Python API (`add_request(cache_salt=...)`), the OpenAI schemas (chat and
completions), gRPC's `SamplingParams.cache_salt`, and the batch job's lines; a salt that is not a
non-empty string of at most `MAX_CACHE_SALT_CHARS` is refused naming `cache_salt`.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
from transformers import GenerationConfig

import cbserve
from cbserve.batch.requests import RequestDefaults, to_worker_request
from cbserve.batch.schema import BatchLine
from cbserve.cluster.settings import ClusterArgs
from cbserve.errors import InvalidRequestError
from cbserve.scheduler.block_manager import BlockManager
from cbserve.scheduler.request import Request
from cbserve.serving.api_errors import APIError
from cbserve.serving.front import grpc_service
from cbserve.serving.front.json_body import parse_request
from cbserve.serving.front.openai_service import OpenAIService
from cbserve.serving.front.schemas import ChatCompletionRequest, CompletionRequest
from cbserve.serving.protocol import Sampling, WorkerRequest
from cbserve.serving.replica.generation import ModelInfo, submit
from cbserve.workers.factory import build_engine
from cbserve.workers.kv.node_pool import NodeKVPool
from cbserve.workers.validation import MAX_CACHE_SALT_CHARS
from tests.support.tiny_models import random_prompts, tiny_model

PAGE = 16
PROMPT = random_prompts([5 * PAGE + 3], seed=7)[0]  # five full pages can come from cache (never the last token)
CACHED = 5 * PAGE
MAX_NEW = 6


# -- the block manager: the salt roots the hash chain ----------------------------------------


def _computed(bm: BlockManager, tokens: list[int], salt: str | None) -> int:
    """Admit a request as the scheduler does (match, allocate, compute, register, finish);
    returns the tokens it found in cache."""
    request = Request(request_id=uuid.uuid4().hex, prompt_ids=list(tokens), max_new_tokens=1,
                      eos_token_ids=frozenset(), cache_salt=salt)
    bm.match_prefix(request)
    hit = request.num_computed
    assert bm.allocate(request, request.num_tokens)
    request.num_computed = request.num_tokens
    bm.register_full_pages(request)
    bm.free(request)
    return hit


def test_pages_are_shared_only_within_one_salt() -> None:
    bm = BlockManager(num_blocks=64, page_size=PAGE, enable_prefix_caching=True)
    assert _computed(bm, PROMPT, None) == 0
    assert _computed(bm, PROMPT, "tenant-a") == 0  # the unsalted pages are not a's
    assert _computed(bm, PROMPT, "tenant-a") == CACHED  # a's own pages are
    assert _computed(bm, PROMPT, "tenant-b") == 0
    assert _computed(bm, PROMPT, "tenant-") == 0  # a prefix of a's salt is another salt
    assert _computed(bm, PROMPT, None) == CACHED  # and no salt still finds the unsalted pages
    hashes = set()
    for salt in (None, "tenant-a", "tenant-b"):
        r = Request(request_id=str(salt), prompt_ids=list(PROMPT), max_new_tokens=1, eos_token_ids=frozenset(),
                    cache_salt=salt)
        hashes.add(tuple(bm.prompt_hashes(r)))  # what the scheduler waits on (pages in flight): salted too
    assert len(hashes) == 3


# -- the Python API ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manager():
    mgr = cbserve.init_continuous_batching(
        tiny_model("llama"), generation_config=GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False,
                                                                eos_token_id=None),
        continuous_batching_config=cbserve.ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=256,
                                                                    per_request_processors=True))  # as a replica
    mgr.start()
    try:
        yield mgr
    finally:
        mgr.stop(block=True, timeout=30)
        mgr.destroy()


def _generate(manager, **kwargs) -> tuple[list[int], int]:
    """The request's tokens and the prompt tokens it found in the engine's prefix cache."""
    before = manager.engine.stats()["prefix_hit_tokens"]
    rid = manager.add_request(PROMPT, max_new_tokens=MAX_NEW, **kwargs)
    out = manager.get_result(rid, timeout=60)
    assert out is not None and out.is_finished() and out.error is None, out
    return out.generated_tokens, manager.engine.stats()["prefix_hit_tokens"] - before


def test_add_request_cache_salt_isolates_the_prefix_cache(manager) -> None:
    salt_a, salt_b = "a" * 43, "b" * 43  # vLLM's advice: long and random enough to be unguessable
    runs = [_generate(manager, **kw) for kw in ({}, {"cache_salt": salt_a}, {"cache_salt": salt_a},
                                                 {"cache_salt": salt_b}, {})]
    assert [hits for _, hits in runs] == [0, 0, CACHED, 0, CACHED]
    assert all(tokens == runs[0][0] for tokens, _ in runs)  # the same tokens, hit or miss


@pytest.mark.parametrize("bad, got", [("", "a string of 0 characters"), (7, "int"), (["a"], "list"),
                                      ("x" * (MAX_CACHE_SALT_CHARS + 1), f"{MAX_CACHE_SALT_CHARS + 1} characters")])
def test_a_bad_cache_salt_is_refused_naming_it(manager, bad, got) -> None:
    with pytest.raises(InvalidRequestError, match=got) as err:
        manager.add_request(PROMPT, max_new_tokens=1, cache_salt=bad)
    assert err.value.field == "cache_salt" and "non-empty string of at most 1024 characters" in err.value.message
    tokens, _ = _generate(manager, cache_salt="x" * MAX_CACHE_SALT_CHARS)  # the longest allowed
    assert len(tokens) == MAX_NEW


def test_the_replica_request_path_passes_the_salt_to_the_engine(manager) -> None:
    """A `WorkerRequest` (what the HTTP, gRPC and batch fronts send a replica) reaches the engine
    with its salt: `generation.submit`, as `run_request` calls it."""
    info = ModelInfo(eos_token_id=None, max_context=512, default_max_tokens=MAX_NEW)
    salt = uuid.uuid4().hex
    hits = []
    for i in range(2):
        before = manager.engine.stats()["prefix_hit_tokens"]
        wreq = WorkerRequest(request_id=f"w{i}-{salt}", prompt_ids=PROMPT, max_tokens=MAX_NEW,
                             sampling=Sampling(temperature=0.0, cache_salt=salt))
        _, rid = submit(manager, None, info, wreq)
        for _ in manager.request_id_iter(rid):
            pass
        hits.append(manager.engine.stats()["prefix_hit_tokens"] - before)
    assert hits == [0, CACHED]  # a new salt: nothing cached before the first; its pages for the second


# -- the fronts ----------------------------------------------------------------------------------


def _service() -> OpenAIService:
    return OpenAIService(ClusterArgs(served_model_name="tiny"), open_choice=None)


@pytest.mark.parametrize("schema, body", [(CompletionRequest, {"prompt": [1, 2, 3], "n": 2}),
                                          (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})])
def test_openai_requests_carry_cache_salt(schema, body) -> None:
    req = parse_request(json.dumps({**body, "cache_salt": "s3cret"}).encode(), schema)
    service = _service()
    wreqs = (service.completion_requests(req, "r") if schema is CompletionRequest
             else service.chat_requests(req, "r"))
    assert [w.sampling.engine_kwargs()["cache_salt"] for w in wreqs] == ["s3cret"] * len(wreqs)
    with pytest.raises(APIError) as err:  # a salt is a string, not coerced
        parse_request(json.dumps({**body, "cache_salt": 5}).encode(), schema)
    assert err.value.status == 400 and err.value.param == "cache_salt"


def test_grpc_sampling_carries_cache_salt() -> None:
    from cbserve.serving.protos import generate_pb2

    msg = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]),
                                       sampling=generate_pb2.SamplingParams(cache_salt="s3cret"))
    wreq = grpc_service.to_worker_request(msg, _service())
    assert wreq.sampling.cache_salt == "s3cret"
    unsalted = grpc_service.to_worker_request(generate_pb2.GenerateRequest(token_ids=msg.token_ids), _service())
    assert unsalted.sampling.cache_salt is None
    assert grpc_service.grpc_field("cache_salt", wreq) == "sampling.cache_salt"  # how a refusal names it


def test_batch_lines_carry_cache_salt() -> None:
    line = BatchLine.model_validate({"id": 1, "input_ids": [1, 2, 3], "cache_salt": "s3cret"})
    wreq = to_worker_request(line, "r", RequestDefaults(), chat_template=False)
    assert wreq.sampling.cache_salt == "s3cret"
    with pytest.raises(ValueError, match="cache_salt"):
        BatchLine.model_validate({"id": 1, "input_ids": [1, 2, 3], "cache_salt": 5})


# -- the node pool: the same keying across engines ----------------------------------------------


def _engine_run(pool_name: str, salt: str | None) -> tuple[list[int], int]:
    """One engine of the node (a fresh own cache): its tokens and the prompt tokens it pulled
    from the node pool."""
    cfg = cbserve.ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=256,
                                           cpu_offload_space=0.002, node_kv_pool=pool_name)
    engine = build_engine(tiny_model("llama"), GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False,
                                                                eos_token_id=None), cfg)
    try:
        request = engine.make_request(PROMPT, "req")
        request.cache_salt = salt  # as the manager sets it from add_request(cache_salt=...)
        engine.add_request(request)
        while engine.has_work:
            engine.step()
    finally:
        engine.release_model()
    return request.generated, engine.scheduler.host_pages.num_node_hit_tokens


def test_node_pool_pages_honour_the_salt(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBSERVE_NODE_KV_POOL_DIR", str(tmp_path))
    name = f"salt-{os.getpid()}"
    owner = NodeKVPool.create(name, 8 << 20)
    try:
        runs = [_engine_run(name, salt) for salt in ("tenant-a", None, "tenant-b", "tenant-a", None)]
    finally:
        owner.close()
    assert [pulled for _, pulled in runs] == [0, 0, 0, CACHED, CACHED]
    assert all(tokens == runs[0][0] for tokens, _ in runs)
