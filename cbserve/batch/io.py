"""The output file of a batch job: resuming from it, and appending to it.

Records are appended one line at a time and flushed as each request finishes, so a crash loses at
most the requests in flight (and may leave a torn last line). On start, `prepare_output` reads
what an earlier run wrote, repairs the file and returns the keys of the lines already done:

- a torn last line (no newline and not a whole JSON object) is cut off;
- a complete last line missing only its newline gets one;
- lines that are not JSON, and `engine_error` records (failures of the engine, not of the line),
  are removed so that their lines run again; the file is then rewritten atomically.

One job at a time writes an output: `OutputLock` holds an exclusive `flock` on `<output>.lock`
beside it for the whole job (a file of its own: the atomic rewrite replaces the output's inode).
The kernel drops the lock when the job's process dies, even by SIGKILL, so a resume never waits
for a dead job; the lock file stays (removing it would let two jobs lock different inodes).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Self

from cbserve.batch.schema import RETRYABLE_ERRORS, ResultLine, record_key

logger = logging.getLogger(__name__)


@dataclass
class ResumeState:
    done: set[str] = field(default_factory=set)
    kept: int = 0
    torn: bool = False
    dropped_retryable: int = 0
    dropped_invalid: int = 0


def _parse_record(line: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def prepare_output(path: Path) -> ResumeState:
    """Repair `path` (see module doc) and return which lines it already holds."""
    state = ResumeState()
    if not path.exists():
        return state
    data = path.read_bytes()
    if not data:
        return state
    pieces = data.split(b"\n")
    tail = pieces.pop()  # b"" when the file ends with a newline
    tail_record = _parse_record(tail) if tail.strip() else None
    if tail.strip() and tail_record is None:
        state.torn = True
        logger.warning(
            "%s: cutting off a torn last line (%d bytes) left by an interrupted run", path, len(tail)
        )
    elif tail_record is not None:
        pieces.append(tail)  # complete, only its newline is missing
    kept: list[bytes] = []
    for raw in pieces:
        if not raw.strip():
            continue
        record = _parse_record(raw)
        key = record_key(record) if record is not None else None
        if record is None or key is None:
            state.dropped_invalid += 1
            logger.warning("%s: dropping a line that is not a record of this job: %.80r", path, raw)
            continue
        if record.get("error_type") in RETRYABLE_ERRORS:
            state.dropped_retryable += 1
            continue
        state.done.add(key)
        kept.append(raw)
    state.kept = len(kept)
    if state.dropped_invalid or state.dropped_retryable:
        _rewrite(path, kept)
    elif state.torn:
        with open(path, "r+b") as f:
            f.truncate(len(data) - len(tail))
    elif tail_record is not None:
        with open(path, "ab") as f:
            f.write(b"\n")
    if state.dropped_retryable:
        logger.info("%s: %d lines that failed in the engine will run again", path, state.dropped_retryable)
    return state


def _rewrite(path: Path, lines: list[bytes]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for line in lines:
                f.write(line + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class OutputInUseError(RuntimeError):
    """Another batch job holds the output's lock."""


class OutputLock:
    """An exclusive, non-blocking `flock` on `<output>.lock` (see the module doc)."""

    def __init__(self, output: Path):
        resolved = output.resolve()  # a symlink or another spelling of the path locks the same file
        self.path = resolved.with_name(resolved.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            output = self.path.with_name(self.path.name.removesuffix(".lock"))
            raise OutputInUseError(
                f"--output: {output} is being written by another batch job ({holder} holds {self.path}); "
                "wait for it to end or choose another --output"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ResultWriter:
    """Appends records, one flushed line each; fsyncs every `sync_every` records and on close."""

    def __init__(self, path: Path, sync_every: int = 100):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._sync_every = max(1, sync_every)
        self._unsynced = 0

    def write(self, record: ResultLine) -> None:
        self._file.write(record.to_json() + "\n")  # one write: a crash can tear only this line
        self._file.flush()
        self._unsynced += 1
        if self._unsynced >= self._sync_every:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._file.fileno())
        self._unsynced = 0

    def close(self) -> None:
        if not self._file.closed:
            self.sync()
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
