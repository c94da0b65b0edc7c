"""A thinking model's reasoning split out of its output (issue 31): `<think> ... </think>` becomes
`reasoning_content`, whole or streamed, wherever the piece boundaries fall; the replica says how
the output begins from the chat template and the rendered prompt."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest

from cbserve.serving.front.chat_replies import ChatRendering
from cbserve.serving.front.reasoning import ThinkSplitter, split_reasoning
from cbserve.serving.front.replies import ChoiceResult, Piece
from cbserve.serving.protocol import Constraint, WorkerRequest
from cbserve.serving.replica.generation import reasoning_mode

CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
CASES = [  # (mode, output, reasoning, content)
    ("tagged", "<think>\nthe user greets</think>\n\nHello!", "\nthe user greets", "Hello!"),
    ("tagged", "  <think>a</think>b", "a", "b"),
    ("tagged", "Hello, no thinking", None, "Hello, no thinking"),
    ("tagged", "<thin", None, "<thin"),  # never became the tag
    ("tagged", "<think>cut short by max_tokens", "cut short by max_tokens", ""),
    ("open", "already thinking</think>\n\nAnswer", "already thinking", "Answer"),
    ("open", "only thinking", "only thinking", ""),
    ("off", "<think>kept</think>as is", None, "<think>kept</think>as is"),
]


@pytest.mark.parametrize(("mode", "output", "reasoning", "content"), CASES)
def test_split_whole_and_streamed_at_every_boundary(mode: str, output: str, reasoning: str | None,
                                                    content: str) -> None:
    assert split_reasoning(output, mode) == (reasoning, content)
    if mode == "off":
        return
    for size in (1, 2, 3, 7):  # tags cut across pieces anywhere
        splitter, got_r, got_c = ThinkSplitter(inside=mode == "open"), "", ""
        for i in range(0, len(output), size):
            r, c = splitter.feed(output[i : i + size])
            got_r, got_c = got_r + r, got_c + c
        r, c = splitter.flush()
        assert (got_r + r, got_c + c) == (reasoning or "", content), size


def _stream(rendering: ChatRendering, mode: str, output: str, finish: str) -> list[dict[str, Any]]:
    stream, chunks = rendering.stream(0, mode), []
    for ch in output:
        chunks += stream.chunks(Piece(text=ch, token_ids=[1]))
    chunks += stream.chunks(Piece(finish_reason=finish))
    return [c.model_dump() for c in chunks]


def test_a_choice_renders_reasoning_content_whole_and_streamed() -> None:
    output = "<think>check the clock</think>\n\n" + CALL
    for mode, calls in (("auto", 1), ("none", 0)):
        rendering = ChatRendering(tool_mode=mode)
        choice = rendering.choice(0, ChoiceResult(text=output, finish_reason="stop", reasoning="tagged")).model_dump()
        message = choice["message"]
        assert message["reasoning_content"] == "check the clock"
        assert len(message.get("tool_calls") or []) == calls and (calls or message["content"] == CALL)
        deltas = [c["delta"] for c in _stream(rendering, "tagged", output, "stop")]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "check the clock"
        pieces = [tc for d in deltas for tc in d.get("tool_calls") or []]
        assert sum(1 for tc in pieces if tc.get("id")) == calls  # a call's id and name in its first delta
        if calls:  # then its arguments as they come
            arguments = "".join(tc["function"]["arguments"] or "" for tc in pieces)
            assert json.loads(arguments) == json.loads(message["tool_calls"][0]["function"]["arguments"])
        assert "<think>" not in "".join(d.get("content") or "" for d in deltas)
    # Asked-for logprobs come for every token, reasoning ones included (on the piece's first chunk).
    stream, sent = ChatRendering(logprobs=True).stream(0, "tagged"), []
    for ch in output:
        for c in stream.chunks(Piece(text=ch, token_ids=[1], logprobs=[-0.5], token_texts=[ch])):
            sent += [t["token"] for t in ((c.model_dump().get("logprobs") or {}).get("content") or [])]
    assert "".join(sent) == output
    plain = ChatRendering().choice(0, ChoiceResult(text="hi", finish_reason="stop")).model_dump()
    assert "reasoning_content" not in plain["message"]  # other models: the field is left out


class Tok:
    """A tokenizer stand-in: ids are characters."""

    def __init__(self, template: str) -> None:
        self.chat_template = template

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def test_the_replica_says_how_the_output_begins() -> None:
    chat = WorkerRequest(request_id="r", messages=[{"role": "user", "content": "hi"}])
    thinking = Tok("{{ messages }}<think>")
    prompt = [ord(c) for c in "<|user|>hi<|assistant|>"]
    assert reasoning_mode(thinking, chat, prompt) == "tagged"  # Qwen3: the output opens the block
    assert reasoning_mode(thinking, chat, prompt + [ord(c) for c in "<think>\n"]) == "open"  # DeepSeek-R1
    assert reasoning_mode(thinking, chat, prompt + [ord(c) for c in "<think>\n\n</think>\n\n"]) == "tagged"
    assert reasoning_mode(Tok("{{ messages }}"), chat, prompt) == "off"  # no think tags in the template
    assert reasoning_mode(thinking, WorkerRequest(request_id="r", prompt="hi"), prompt) == "off"
    constrained = chat.model_copy(update={"constraint": Constraint(kind="regex", spec="a+", field="guided_regex")})
    assert reasoning_mode(thinking, constrained, prompt) == "off"  # the output is the constraint's


def test_served_through_the_replica_with_a_thinking_template(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The tiny model under a DeepSeek-R1-like template (the prompt opens the block): its output
    never closes it, so all of it is reasoning, and the start event carries the mode end to end."""
    import cbserve
    from cbserve.cluster.settings import ClusterArgs
    from cbserve.serving.constraints import Grammars
    from cbserve.serving.front.json_body import parse_request
    from cbserve.serving.front.openai_service import OpenAIService
    from cbserve.serving.front.replies import ChoiceStream
    from cbserve.serving.front.schemas import ChatCompletionRequest
    from cbserve.serving.replica.generation import ModelInfo, run_request
    from tests.support.cluster import running_manager, tiny_model_dir

    model, tok = cbserve.load_model(str(tiny_model_dir(tmp_path_factory)), dtype="float32")
    tok = copy.deepcopy(tok)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}<think>\n"
    info = ModelInfo(eos_token_id=None, max_context=512, default_max_tokens=None,
                     grammars=Grammars(tok, model.config.vocab_size, None))

    with running_manager(model, num_blocks=64) as manager:
        async def open_choice(wreq: WorkerRequest) -> ChoiceStream:
            gen = run_request(manager, tok, info, wreq, "local")
            return ChoiceStream(start=await gen.__anext__(), events=gen, cancel=lambda: None)

        service = OpenAIService(ClusterArgs(served_model_name="tiny"), open_choice)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                "temperature": 0, "ignore_eos": True}
        req = parse_request(json.dumps(body).encode(), ChatCompletionRequest)
        message = asyncio.run(service.chat(req)).body.model_dump()["choices"][0]["message"]
        completion = parse_request(json.dumps({**body, "guided_regex": "[a-z]+"}).encode(), ChatCompletionRequest)
        constrained = asyncio.run(service.chat(completion)).body.model_dump()["choices"][0]["message"]
    assert message["content"] == "" and message["reasoning_content"]
    assert "reasoning_content" not in constrained and constrained["content"]
