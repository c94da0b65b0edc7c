"""A per-node KV pool: one bounded host memory pool shared by the engines (worker replicas) of a
node, holding KV pages keyed by their prefix hash chain, so that an engine that misses a prefix
in its own cache copies it from the pool instead of recomputing it.

Memory: one file in /dev/shm or `$CBSERVE_NODE_KV_POOL_DIR` (`NodeKVPool.create`, by the pool's owner: a node-level process
that outlives the replicas), memory-mapped by every engine that attaches by name. The owner
gives only a capacity; the first engine to attach formats it for its pages (page size, bytes
per page, model fingerprint) and engines whose pages differ do not use it.

The file holds prompts' token ids and KV: it is created with mode 0600 (owner only, whatever
the umask) under a temporary name and renamed when whole, its memory reserved up front
(`posix_fallocate`: a full tmpfs is a refusal at start, not a SIGBUS at the first page written
past its end); engines attach only to a regular file of their own user with that mode (another
local user can neither read the pages nor plant a pool of crafted pages). Creating a pool first
removes this user's pool files whose owner died (a crash leaves its file, and its memory).

    header | slot table [slots, 8] int64 | slot tokens [slots, page_size] int32 | slot pages

A slot holds one page of every layer's K and V ([2, layers, page_size, kv_heads, head_dim]),
the page's tokens, the key of the page and of its parent (a chain: blake2b of the parent's key
and the page's tokens, from a salt that fingerprints the model), a checksum of tokens and data,
its generation, its writer and when it was last used. Replacement is least recently used.

Concurrency and faults: the slot table changes under an exclusive `flock` on the file (released
by the kernel if its holder dies). A writer claims a slot (WRITING, generation + 1), copies and
checksums outside the lock, then publishes it (READY) if the generation is still its own. A
reader copies outside the lock and keeps the page only if its tokens and checksum match and the
generation did not change meanwhile: a page being rewritten, torn, or written by a dead engine
is a miss, never a wrong page. A slot left WRITING by a dead engine is reclaimed. When the owner
dies or closes the pool, engines stop using it (every lookup misses).
"""

from __future__ import annotations

import array
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import stat
import weakref
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAGIC, VERSION = 0x63624B56504F4F4C, 1  # "cbKVPOOL"
HEADER_SLOTS = 64
# Header slots.
H_MAGIC, H_VERSION, H_CAPACITY, H_OWNER_PID, H_OWNER_START, H_CLOSED, H_FORMATTED, H_PAGE_SIZE, H_PAGE_BYTES, \
    H_FINGERPRINT, H_SLOTS, H_CLOCK = range(12)
# Slot table fields.
STATE, KEY, PARENT, LAST_USED, CHECKSUM, WRITER, GEN = range(7)
FIELDS = 8
FREE, WRITING, READY = 0, 1, 2
ALIGN = 64


DIRECTORY_ENV = "CBSERVE_NODE_KV_POOL_DIR"
FILE_PREFIX = "cbserve-kv-"
FILE_MODE = 0o600  # owner only: the pages are prompts' tokens and their KV
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC  # a planted symlink is refused, not followed


def default_directory() -> Path:
    """`$CBSERVE_NODE_KV_POOL_DIR` (a memory-backed folder every engine of the node sees: under
    Kubernetes, an emptyDir of medium Memory mounted in each pod), else /dev/shm."""
    if os.environ.get(DIRECTORY_ENV):
        return Path(os.environ[DIRECTORY_ENV])
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def pool_path(name: str, directory: str | os.PathLike[str] | None = None) -> Path:
    if not name or "/" in name:
        raise ValueError(f"node KV pool name must be a non-empty file name, got {name!r}")
    return Path(directory or default_directory()) / f"{FILE_PREFIX}{name}"


def _process_start(pid: int) -> int:
    """The process's start time (clock ticks after boot), 0 when unknown: a pid alone may be reused."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return start == 0 or _process_start(pid) in (0, start)


def to_signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def chain_keys(tokens: list[int], page_size: int, num_pages: int, salt: int) -> list[int]:
    """Keys of the first `num_pages` full pages of `tokens`: each hashes its parent's key and its
    tokens (stable across processes, unlike Python's `hash`)."""
    keys, parent = [], salt
    for i in range(num_pages):
        h = hashlib.blake2b(parent.to_bytes(8, "little", signed=True), digest_size=8)
        h.update(array.array("q", tokens[i * page_size : (i + 1) * page_size]).tobytes())
        parent = to_signed(int.from_bytes(h.digest(), "little"))
        keys.append(parent)
    return keys


def _check_private(path: Path, st: os.stat_result) -> None:
    """A pool file this user owns, that no one else may read or write."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private node KV pool file (a regular file of uid {os.geteuid()}, "
                              f"mode 0600): uid {st.st_uid}, mode {stat.filemode(st.st_mode)}")


def _reserve(fd: int, capacity_bytes: int, path: Path) -> None:
    """The whole pool's memory, now: on tmpfs a sparse file that outgrows the free space kills
    the engine that touches the missing page (SIGBUS) instead of refusing the pool."""
    try:
        os.posix_fallocate(fd, 0, capacity_bytes)
    except OSError as exc:
        vfs = os.statvfs(path.parent)
        free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
        raise OSError(exc.errno or errno.ENOSPC,
                      f"node KV pool {path.name}: cannot reserve its {capacity_bytes} bytes in {path.parent} "
                      f"({free} of {total} bytes free: {exc.strerror}); lower the node's KV pool budget or give "
                      f"{path.parent} more room") from exc


def _stale(path: Path) -> bool:
    """This user's pool file whose owner is gone (or closed it), or a temporary file of a
    creator that died before renaming it."""
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return False
    if path.suffix == ".tmp":
        pid = path.name.rsplit(".", 2)[-2]
        return pid.isdigit() and not _alive(int(pid), 0)
    fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    try:
        raw = os.pread(fd, (H_CLOSED + 1) * 8, 0)
        if len(raw) < (H_CLOSED + 1) * 8:
            return False
        h = array.array("q", raw)
        if h[H_MAGIC] != MAGIC:
            return False  # not a pool of ours: left alone
        dead = bool(h[H_CLOSED]) or not _alive(h[H_OWNER_PID], h[H_OWNER_START])
        return dead and os.fstat(fd).st_ino == os.lstat(path).st_ino  # still the file just read
    finally:
        os.close(fd)


def remove_stale(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove this user's pool files in `directory` whose owners died; returns their paths."""
    removed = []
    for path in sorted(Path(directory or default_directory()).glob(FILE_PREFIX + "*")):
        try:
            if _stale(path):
                path.unlink()
                removed.append(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    if removed:
        logger.info("removed %d node KV pool file(s) of dead owners: %s", len(removed),
                    ", ".join(p.name for p in removed))
    return removed


def _checksum(data: torch.Tensor, tokens: torch.Tensor) -> int:
    return zlib.crc32(tokens.numpy().tobytes(), zlib.crc32(data.numpy()))


class NodeKVPool:
    """One mapping of the node's pool file; see the module doc. Not thread-safe: one per engine."""

    def __init__(self, path: Path, owner: bool) -> None:
        self.path, self.owner = path, owner
        self.fd = os.open(path, os.O_RDWR | _OPEN_FLAGS)
        try:
            _check_private(path, os.fstat(self.fd))
        except PermissionError:
            os.close(self.fd)
            raise
        self.size = os.fstat(self.fd).st_size
        self.map = mmap.mmap(self.fd, self.size)
        self.header = torch.frombuffer(self.map, dtype=torch.int64, count=HEADER_SLOTS)
        if self.header[H_MAGIC] != MAGIC or self.header[H_VERSION] != VERSION:
            raise ValueError(f"{path} is not a cbserve node KV pool (version {VERSION})")
        self._finalizer = weakref.finalize(self, NodeKVPool._release, self.map, self.fd)
        self._layout()

    @staticmethod
    def _release(mapping: mmap.mmap, fd: int) -> None:
        try:
            mapping.close()
        except BufferError:  # views still alive: the mapping goes with the process
            pass
        os.close(fd)

    # -- owning and attaching ----------------------------------------------------------------

    @classmethod
    def create(cls, name: str, capacity_bytes: int, directory: str | os.PathLike[str] | None = None) -> NodeKVPool:
        """The owner: a pool file of `capacity_bytes`, reserved in full. Files of dead owners are
        removed first; a file of the same name whose owner lives is refused."""
        path = pool_path(name, directory)
        remove_stale(path.parent)
        if path.exists():
            try:
                stale = cls(path, owner=False)
                live = stale.alive()
                stale.detach()
            except (ValueError, OSError):
                live = False
            if live:
                raise FileExistsError(f"node KV pool {name!r} ({path}) is owned by a live process")
            path.unlink(missing_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)  # this pid's own leftover (a pid is reused)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # the umask may have taken the owner's bits too
            _reserve(fd, capacity_bytes, path)
            header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
            header[H_MAGIC], header[H_VERSION], header[H_CAPACITY] = MAGIC, VERSION, capacity_bytes
            header[H_OWNER_PID], header[H_OWNER_START] = os.getpid(), _process_start(os.getpid())
            os.pwrite(fd, header.numpy().tobytes(), 0)
            os.replace(tmp, path)  # whole or absent: an engine never maps a half-made header
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return cls(path, owner=True)

    @classmethod
    def attach(cls, name: str, directory: str | os.PathLike[str] | None = None) -> NodeKVPool:
        path = pool_path(name, directory)
        if not path.exists():
            raise FileNotFoundError(f"no node KV pool named {name!r} ({path}): its owner creates it first")
        return cls(path, owner=False)

    def close(self) -> None:
        """The owner: mark the pool closed (engines stop using it) and remove its file."""
        if self.owner:
            with self._locked():
                self.header[H_CLOSED] = 1
            self.path.unlink(missing_ok=True)
        self.detach()

    def detach(self) -> None:
        self.header = self.meta = self.tokens = self.data = None
        self._finalizer()

    def alive(self) -> bool:
        """The pool may be used: not closed, its owner process still there."""
        h = self.header
        return h is not None and not h[H_CLOSED] and _alive(int(h[H_OWNER_PID]), int(h[H_OWNER_START]))

    @contextmanager
    def _locked(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    # -- format ------------------------------------------------------------------------------

    def _layout(self) -> None:
        h = self.header
        self.num_slots = int(h[H_SLOTS])
        self.page_size, self.page_bytes = int(h[H_PAGE_SIZE]), int(h[H_PAGE_BYTES])
        if not h[H_FORMATTED]:
            self.meta = self.tokens = self.data = None
            return
        n, offset = self.num_slots, HEADER_SLOTS * 8
        self.meta = torch.frombuffer(self.map, dtype=torch.int64, count=n * FIELDS, offset=offset).view(n, FIELDS)
        offset += n * FIELDS * 8
        self.tokens = torch.frombuffer(self.map, dtype=torch.int32, count=n * self.page_size,
                                       offset=offset).view(n, self.page_size)
        offset = -(-(offset + n * self.page_size * 4) // ALIGN) * ALIGN
        self.data = torch.frombuffer(self.map, dtype=torch.uint8, count=n * self.page_bytes,
                                     offset=offset).view(n, self.page_bytes)

    def format(self, page_size: int, page_bytes: int, fingerprint: int) -> bool:
        """Format an unformatted pool for these pages, or check a formatted one holds them;
        False when it holds other pages (another model, dtype or page size)."""
        with self._locked():
            h = self.header
            if not h[H_FORMATTED]:
                per_slot = FIELDS * 8 + page_size * 4 + page_bytes
                slots = (int(h[H_CAPACITY]) - HEADER_SLOTS * 8 - ALIGN) // per_slot
                if slots < 1:
                    raise ValueError(f"node KV pool {self.path} ({int(h[H_CAPACITY])} bytes) cannot hold one page "
                                     f"of {page_bytes} bytes")
                h[H_PAGE_SIZE], h[H_PAGE_BYTES], h[H_FINGERPRINT], h[H_SLOTS] = page_size, page_bytes, fingerprint, slots
                h[H_FORMATTED] = 1  # the slot table is all zeros: every slot FREE
            self._layout()
            return (self.page_size, self.page_bytes, int(h[H_FINGERPRINT])) == (page_size, page_bytes, fingerprint)

    # -- pages -------------------------------------------------------------------------------

    def _find(self, key: int, parent: int) -> int | None:
        m = self.meta
        hit = ((m[:, KEY] == key) & (m[:, PARENT] == parent) & (m[:, STATE] == READY)).nonzero()
        return int(hit[0, 0]) if len(hit) else None

    def holds(self, key: int, parent: int) -> bool:
        with self._locked():
            return self._find(key, parent) is not None

    def _victim(self) -> int:
        """A free slot, else one a dead engine left half written, else the least recently used."""
        state = self.meta[:, STATE]
        free = (state == FREE).nonzero()
        if len(free):
            return int(free[0, 0])
        for slot in (state == WRITING).nonzero()[:, 0].tolist():
            if not _alive(int(self.meta[slot, WRITER]), 0):
                return slot
        used = self.meta[:, LAST_USED].masked_fill(state != READY, torch.iinfo(torch.int64).max)
        return int(used.argmin())

    def _tick(self) -> int:
        self.header[H_CLOCK] += 1
        return int(self.header[H_CLOCK])

    def store(self, key: int, parent: int, tokens: list[int], data: torch.Tensor) -> bool:
        """Publish one page (`data`: its bytes, uint8 [page_bytes]); False when it was there
        already or the slot was taken over while it was written."""
        with self._locked():
            if self._find(key, parent) is not None:
                return False
            slot = self._victim()
            row = self.meta[slot]
            gen = int(row[GEN]) + 1
            row[STATE], row[GEN], row[WRITER], row[KEY], row[PARENT] = WRITING, gen, os.getpid(), key, parent
        self.data[slot].copy_(data)
        self.tokens[slot].copy_(torch.tensor(tokens, dtype=torch.int32))
        checksum = _checksum(data, self.tokens[slot])
        with self._locked():
            if int(row[GEN]) != gen or int(row[STATE]) != WRITING:
                return False
            row[CHECKSUM], row[LAST_USED], row[STATE] = checksum, self._tick(), READY
        return True

    def fetch(self, key: int, parent: int, tokens: list[int]) -> torch.Tensor | None:
        """A copy of the page's bytes, verified (tokens, checksum, not rewritten meanwhile), or None."""
        with self._locked():
            slot = self._find(key, parent)
            if slot is None:
                return None
            row = self.meta[slot]
            gen, checksum = int(row[GEN]), int(row[CHECKSUM])
            row[LAST_USED] = self._tick()
        data, held = self.data[slot].clone(), self.tokens[slot].clone()
        if held.tolist() != list(tokens) or _checksum(data, held) != checksum:
            return None
        with self._locked():
            if int(row[GEN]) != gen or int(row[STATE]) != READY:
                return None
        return data

    def stats(self) -> dict[str, int]:
        if self.meta is None and self.header is not None and self.header[H_FORMATTED]:
            self._layout()  # an engine formatted it since this process mapped it (the owner's view)
        if self.meta is None:
            return {"slots": 0, "ready": 0}
        return {"slots": self.num_slots, "ready": int((self.meta[:, STATE] == READY).sum())}
