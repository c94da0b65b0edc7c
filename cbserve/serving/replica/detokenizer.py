"""Incremental detokenization and stop strings, for streamed text.

`IncrementalDetokenizer` turns token ids into text deltas without ever emitting half of a
multi-byte character (a byte-level BPE token can end mid-character; its decode then ends in
U+FFFD, and the text is held until the character completes). It decodes only a short window of
recent tokens per step (the offsets scheme of vLLM / mini-sglang), so a long generation costs
O(1) per token, and the concatenated deltas equal `tokenizer.decode(all_ids)`.

`StopStringMatcher` cuts text at the first stop string, holding back just enough characters
that a stop string split across deltas is still caught and never streamed.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def step(self, new_ids: list[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self.ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return any held-back text (an incomplete character at the end decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # e.g. a skipped special token: nothing to show yet
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # the last token ends inside a character: wait for the rest
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return delta

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs); may contain U+FFFD."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add text; return what may be emitted now. Sets `stopped` when a stop string is found."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._pending + text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        keep = min(self._hold, len(buf))
        emit, self._pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
        return emit

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
