"""Progress of a batch job: a tqdm bar, a log line every N finished requests, and the final summary."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


@dataclass
class Summary:
    lines: int = 0  # non-blank input lines
    blank: int = 0
    skipped: int = 0  # already in the output from an earlier run
    written: int = 0  # records written by this run
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # by error_type
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    engines: list[dict[str, Any]] = field(default_factory=list)  # what ran the requests

    def as_dict(self) -> dict[str, Any]:
        secs = max(self.elapsed_s, 1e-9)
        return {
            "lines": self.lines,
            "blank": self.blank,
            "skipped": self.skipped,
            "written": self.written,
            "ok": self.ok,
            "errors": dict(self.errors),
            "retries": self.retries,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "elapsed_s": round(self.elapsed_s, 3),
            "requests_per_s": round(self.written / secs, 3),
            "completion_tokens_per_s": round(self.completion_tokens / secs, 3),
            "engines": self.engines,
        }


class Progress:
    def __init__(self, total_lines: int, log_every: int, enabled: bool = True):
        self.summary = Summary(lines=total_lines)
        self._log_every = max(1, log_every)
        self._total = total_lines
        self._start = time.perf_counter()
        self._bar = tqdm(total=total_lines, unit="line", desc="batch", disable=not enabled, mininterval=1.0)

    def skipped(self) -> None:
        self.summary.skipped += 1
        self._bar.update(1)

    def written(
        self, ok: bool, error_type: str | None, prompt_tokens: int = 0, completion_tokens: int = 0
    ) -> None:
        s = self.summary
        s.written += 1
        if ok:
            s.ok += 1
        else:
            s.errors[error_type or "unknown"] += 1
        s.prompt_tokens += prompt_tokens
        s.completion_tokens += completion_tokens
        self._bar.update(1)
        if s.written % self._log_every == 0:
            logger.info("%s", self.line())

    def line(self) -> str:
        s = self.summary
        secs = max(time.perf_counter() - self._start, 1e-9)
        done = s.skipped + s.written
        pct = 100.0 * done / self._total if self._total else 100.0
        return (
            f"batch: {done}/{self._total} lines ({pct:.1f}%): {s.written} written this run, "
            f"{s.skipped} skipped; {s.written / secs:.2f} req/s, {s.completion_tokens / secs:.1f} tok/s, "
            f"{sum(s.errors.values())} errors"
        )

    def close(self) -> Summary:
        self._bar.close()
        self.summary.elapsed_s = time.perf_counter() - self._start
        return self.summary
