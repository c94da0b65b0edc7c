"""A thinking model's reasoning, split out of its output (`reasoning_content`, as vLLM sends it).

Models whose chat template has `<think>` (Qwen3, DeepSeek-R1, SmolLM3) write their reasoning in
`<think> ... </think>` before the answer. The replica says on the choice's `start` event how the
output begins (`WorkerEvent.reasoning`): "tagged" when the output may open a `<think>` block
itself (Qwen3), "open" when the prompt already opened one (DeepSeek-R1's template ends with
`<think>\\n`), "off" for other models and constrained outputs. `ThinkSplitter` cuts streamed text
into (reasoning, content) as it comes, holding back only what could still be a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from cbserve.serving.front.stream_tags import partial_tail

START, END = "<think>", "</think>"


@dataclass
class ThinkSplitter:
    inside: bool = False  # in a think block (from the start when the prompt opened it)
    _buf: str = ""
    _decided: bool = False  # whether the output opens a block is known
    _done: bool = False  # past `</think>` (or no block at all): the rest is content
    _boundary: bool = False  # just past `</think>`: the answer's leading newlines are dropped

    def __post_init__(self) -> None:
        self._decided = self.inside

    def feed(self, text: str) -> tuple[str, str]:
        """Add output text; returns the (reasoning, content) that may be shown now."""
        self._buf += text
        reasoning = content = ""
        if not self._decided:
            head = self._buf.lstrip()
            if START.startswith(head):  # empty or a part of the tag: not known yet
                return "", ""
            self._decided = True
            self.inside = head.startswith(START)
            self._buf = head[len(START):] if self.inside else self._buf
            self._done = not self.inside
        if self.inside:
            at = self._buf.find(END)
            if at < 0:
                keep = partial_tail(self._buf, END)
                reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf = self._buf[:at], self._buf[at + len(END):]
            self.inside, self._done, self._boundary = False, True, True
        if self._boundary:
            self._buf = self._buf.lstrip("\n")
            self._boundary = not self._buf
        content, self._buf = self._buf, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """The output ended: what was held back (an unfinished block is all reasoning)."""
        rest, self._buf = self._buf, ""
        if self.inside:
            return rest, ""
        return "", rest.lstrip("\n") if self._boundary else rest


def split_reasoning(text: str, mode: str) -> tuple[str | None, str]:
    """A whole output as (reasoning or None, content) for a choice's `reasoning` mode."""
    if mode == "off":
        return None, text
    splitter = ThinkSplitter(inside=mode == "open")
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.flush()
    reasoning += more_reasoning
    return (reasoning if reasoning or mode == "open" or text.lstrip().startswith(START) else None), content + more_content
