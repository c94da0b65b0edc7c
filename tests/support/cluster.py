"""Helpers for the cluster tests: a tiny random-weight model and tokenizer, built offline.

Imported by the tests that build a served app or a tiny model folder. Nothing here
downloads anything: the tokenizer is a word-level vocabulary trained in-process.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Words with multi-byte characters so that incremental detokenization is exercised.
WORDS = ["the", "a", "an", "of", "to", "in", "is", "was", "for", "on", "with", "as", "by", "at", "from", "that", "this", "it", "be", "are", "or", "not", "but", "capital", "france", "paris", "sea", "wave", "haiku", "batch", "token", "cache", "page", "model", "engine", "request", "reply", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "hello", "world", "user", "assistant", "system", "café", "naïve", "über", "日本", "東京", "ünïcödé", "🙂", "∑", "½", "—", "é"]


def build_tiny_model(folder: Path, seed: int = 0) -> Path:
    """Save a 2-layer random Llama and a word-level tokenizer with a chat template to `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    # Byte-level BPE, like most LLM tokenizers: multi-byte characters span several tokens, so
    # streamed text must be detokenized incrementally.
    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    core.train_from_iterator(corpus, trainer=trainer)
    vocab = core.get_vocab()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=vocab["<|endoftext|>"],
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits so greedy choices are not near-ties
        model.lm_head.weight.mul_(8.0)
    model.generation_config = GenerationConfig(
        eos_token_id=vocab["<|im_end|>"], bos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"]
    )
    model.save_pretrained(folder)
    return folder


def free_port() -> int:
    """A free port between Ray's worker ports (10002-19999) and the kernel's ephemeral range
    (32768 and up): a port the kernel picks (bind to 0) comes from the range Ray's own connections
    draw from, and one was taken before Serve's proxy could bind it."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, built once per test session (under pytest's base temp folder)."""
    folder = tmp_path_factory.getbasetemp() / "cbserve-tiny-model"
    if not (folder / "config.json").exists():
        build_tiny_model(folder)
    return folder


SERVICER = "cbserve.serving.front.grpc_service.add_generate_servicer"
# A loaded 2-core machine can take longer than Serve's 5 s to ready a proxy (which it then kills).
PROXY_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


def _start_serve(serve: Any) -> tuple[int, int]:
    """Start Serve's proxies; once more on fresh ports if a loaded machine lets the proxy miss its
    start-up deadline."""
    for attempt in range(2):
        http_port, grpc_port = free_port(), free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                        grpc_options={"port": grpc_port, "grpc_servicer_functions": [SERVICER]})
            return http_port, grpc_port
        except Exception:
            if attempt:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


def start_local_ray(**options: Any) -> None:
    """`ray.init(address="local", **options)`, once more if the new cluster's GCS server never
    reported its port: a CI run's pytest process (gRPC printed that other threads were in gRPC
    calls at the fork) timed out waiting for a GCS server that had written no log at all. Ray
    forks it with a Python `preexec_fn`, which is not safe beside other threads: the likely cause."""
    import ray

    for attempt in range(2):
        try:
            ray.init(address="local", **options)
            return
        except RuntimeError as exc:
            if attempt or "Timed out waiting for file" not in str(exc):
                raise
            print(f"ray.init failed ({exc}); starting a new local cluster", flush=True)
            ray.shutdown()


@contextlib.contextmanager
def serve_app(args: dict[str, Any]) -> Iterator[tuple[Any, int, int]]:
    """A local Ray with the cbserve app of `args` at route "/"; yields (serve, http port, gRPC
    port) and shuts everything down afterwards."""
    import ray
    from ray import serve

    from cbserve.cluster.app import build_app

    added = [k for k in PROXY_PATIENCE if k not in os.environ]
    os.environ.update({k: PROXY_PATIENCE[k] for k in added})
    start_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        http_port, grpc_port = _start_serve(serve)
        serve.run(build_app(args), name="cbserve", route_prefix="/")
        yield serve, http_port, grpc_port
    finally:
        serve.shutdown()
        ray.shutdown()
        for k in added:
            os.environ.pop(k, None)


@contextlib.contextmanager
def throttled(pids: list[int], run_s: float = 0.005, stop_s: float = 0.045) -> Iterator[None]:
    """These processes run at about a tenth of their speed inside the block (SIGSTOP / SIGCONT in
    turn). A test that kills a replica mid-generation throttles it while its streams start, so that
    they are still generating at the kill: unthrottled, a fast CI machine had generated the tiny
    model's streams whole before it (the ingress held the rest), and nothing migrated."""
    stop = threading.Event()

    def signal_all(sig: signal.Signals) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def cycle() -> None:
        while not stop.is_set():
            signal_all(signal.SIGSTOP)
            stop.wait(stop_s)
            signal_all(signal.SIGCONT)
            time.sleep(run_s)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        signal_all(signal.SIGCONT)  # never leave a stopped process behind


@contextlib.contextmanager
def running_manager(model: Any, **config: Any) -> Iterator[Any]:
    """A started continuous-batching manager on `model` as the serving tests use it (16 new
    tokens, the model's EOS, processors and logprobs on), stopped and destroyed afterwards."""
    from transformers import GenerationConfig

    import cbserve

    cfg = {"page_size": 8, "num_blocks": 128, "max_batch_tokens": 256, "per_request_processors": True,
           "return_logprobs": True, **config}
    mgr = cbserve.init_continuous_batching(
        model, generation_config=GenerationConfig(max_new_tokens=16, eos_token_id=model.config.eos_token_id),
        continuous_batching_config=cbserve.ContinuousBatchingConfig(**cfg),
    )
    mgr.start()
    try:
        yield mgr
    finally:
        mgr.stop(timeout=30)
        mgr.destroy()


@dataclass
class FakeReplica:
    """What Serve's request router reads of a replica."""

    replica_id: Any
    queue_len: int = 0
    routing_stats: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 100

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len
