"""The NVMe level: swap files in a per-process folder, verified on every read.

* Each process gets its own folder ``<swap dir>/vb-<pid>-<process start>-<random>``, created
  exclusively, so two processes never share swap files.
* The folder is removed at normal interpreter exit and after an uncaught exception (``atexit``),
  and when the :class:`SwapSpace` is closed. Folders left by a process that died (SIGKILL, power
  loss) are removed by the next :class:`SwapSpace` opened on the same swap dir — only those whose
  process is gone (pid not running, or running with a different start time).
* Every write records the byte size and a CRC-32 of the data; a read checks both before the
  bytes are used, so a truncated or altered file raises :class:`SwapCorruptionError`, never
  loads silently.
* Data goes to disk, not to the page cache: with ``O_DIRECT`` where the filesystem supports it
  (through a small page-aligned staging buffer per I/O thread), else buffered writes followed by
  ``fdatasync`` and ``posix_fadvise(DONTNEED)`` (reads by ``DONTNEED``).
* Checksums are CRC-32C (the ``crc32c`` package, hardware-accelerated: ~11 GB/s here, where
  ``zlib.crc32`` does ~2.2 GB/s and would cap the I/O threads below the disk's speed); without
  the package, zlib's CRC-32 is used.
* A write that hits a full disk raises :class:`SwapFullError` naming the folder and the bytes
  needed; the caller's tensor is untouched (it is only freed after a successful write).
"""
from __future__ import annotations

import atexit
import errno
import mmap
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path

import psutil

from apt_model.errors import ConfigError, VBError
from apt_model.log import get_logger
from apt_model.memory.waits import TimedLock

log = get_logger(__name__)

try:
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - the package is a declared dependency
    _crc32c = None

_FOLDER = re.compile(r"^vb-(\d+)-(\d+)-[0-9a-f]+$")
_CHUNK = 8 << 20  # bytes per I/O call (a multiple of the 4 KiB O_DIRECT alignment)
_ALIGN = 4096


def checksum(data, value: int = 0) -> int:
    """CRC-32C of ``data`` (continuing ``value``); zlib's CRC-32 if ``crc32c`` is missing."""
    return _crc32c(data, value) if _crc32c is not None else zlib.crc32(data, value)


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def supports_direct_io(folder: Path) -> bool:
    """Whether files in ``folder`` accept ``O_DIRECT`` writes (tmpfs and some others do not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = folder / ".direct-test"
    buf = mmap.mmap(-1, _ALIGN)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, buf, 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        buf.close()
        try:
            path.unlink()
        except OSError:
            pass


class SwapError(VBError, OSError):
    """Base class of swap-level errors."""


class SwapFullError(SwapError):
    """The swap folder's disk (or the swap budget) cannot take the bytes being evicted."""


class SwapCorruptionError(SwapError):
    """A swap file is truncated, altered, or missing."""


class SwapTimeoutError(SwapError):
    """A wait of the memory stack (a page's read or write, a lock) did not end within
    ``VB_SWAP_TIMEOUT`` seconds; the message names what was awaited (see :mod:`apt_model.memory.waits`)."""


@dataclass
class SwapRecord:
    """Where one page's bytes are on disk: path, byte size, CRC-32."""

    path: Path
    nbytes: int
    crc: int


def default_swap_root() -> Path:
    """``$VB_SWAP_DIR`` or ``<system temp>/apt_model-swap``."""
    env = os.environ.get("VB_SWAP_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / "apt_model-swap"


def _process_start(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def clean_stale_folders(root: Path) -> list[Path]:
    """Remove ``vb-*`` folders under ``root`` whose process is gone; returns what was removed."""
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _FOLDER.match(entry.name)
        if not m or not entry.is_dir():
            continue
        pid, start = int(m.group(1)), int(m.group(2))
        alive = psutil.pid_exists(pid) and _process_start(pid) == start
        if not alive:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            log.info("removed swap folder %s left by process %d, which is gone", entry, pid)
    return removed


def _fadvise_dontneed(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


class SwapSpace:
    """This process's swap folder.

    Args:
        root: the swap dir (``VB_SWAP_DIR``); must exist if given explicitly. None uses
            :func:`default_swap_root` and creates it.
        budget: maximum bytes kept on disk at once (``VB_SWAP_BUDGET``), or None for the disk's
            free space.

    Raises:
        ConfigError: the swap dir does not exist, is not a folder, or is not writable.
    """

    def __init__(self, root: str | os.PathLike | None = None, budget: int | None = None):
        explicit = root is not None or bool(os.environ.get("VB_SWAP_DIR"))
        self.root = Path(root) if root is not None else default_swap_root()
        if not self.root.exists():
            if explicit:
                raise ConfigError(f"swap directory {str(self.root)!r} does not exist; create it or set VB_SWAP_DIR to a folder that does")
            self.root.mkdir(parents=True, exist_ok=True)
        if not self.root.is_dir():
            raise ConfigError(f"swap directory {str(self.root)!r} is not a folder")
        self.stale_removed = clean_stale_folders(self.root)
        start = _process_start(os.getpid()) or int(time.time())
        name = f"vb-{os.getpid()}-{start}-{secrets.token_hex(4)}"
        self.folder = self.root / name
        try:
            self.folder.mkdir(mode=0o700)
            probe = self.folder / ".write-test"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as err:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise ConfigError(f"swap directory {str(self.root)!r} is not writable: {err.strerror or err}") from None
        self.budget = budget
        self.direct = supports_direct_io(self.folder)
        self._tls = threading.local()
        self.bytes_on_disk = 0
        self._records: dict[str, SwapRecord] = {}
        # files of removed pages, left at their size for the page's next write (path -> bytes);
        # counted against the budget and truncated when room is needed (see remove())
        self._stale: dict[Path, int] = {}
        self.stale_bytes = 0
        self._lock = TimedLock(f"swap folder {self.folder}")
        self._closed = False
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.folder), True)
        atexit.register(self.close)

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Delete this process's swap folder and everything in it."""
        if not self._closed:
            self._closed = True
            self._finalizer()
            try:
                atexit.unregister(self.close)
            except Exception:  # noqa: BLE001
                pass

    @property
    def closed(self) -> bool:
        return self._closed

    def free_bytes(self) -> int:
        """Free space on the swap folder's disk, in bytes."""
        return int(shutil.disk_usage(self.folder).free)

    # ---------------------------------------------------------------- I/O (thread-safe per key)
    def _staging(self, n: int) -> mmap.mmap:
        """This thread's page-aligned buffer of at least ``n`` bytes (for O_DIRECT)."""
        buf = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < n:
            if buf is not None:
                buf.close()
            buf = self._tls.buf = mmap.mmap(-1, max(n, _CHUNK))
        return buf

    def write(self, key: str, data: memoryview) -> SwapRecord:
        """Write ``data`` (bytes) as the page ``key``; returns its record.

        The previous record of ``key`` is invalidated first: if this write fails, the page has no
        valid copy on disk, and its caller keeps the bytes in memory (dirty).

        Raises:
            SwapFullError: the disk is full or the swap budget would be exceeded (``data`` is untouched).
            SwapError: other I/O failures.
        """
        n = data.nbytes
        path = self.folder / f"{key}.bin"
        with self._lock:
            old = self._records.pop(key, None)
            old_n = old.nbytes if old else 0
            self.stale_bytes -= self._stale.pop(path, 0)  # this write reuses the file's blocks
            if self.budget is not None and self.bytes_on_disk + self.stale_bytes - old_n + n > self.budget:
                self._reclaim_stale_locked()
            if self.budget is not None and self.bytes_on_disk - old_n + n > self.budget:
                self.bytes_on_disk -= old_n
                if old_n:  # the old copy is invalid now, its file still holds old_n bytes
                    self._stale[path] = old_n
                    self.stale_bytes += old_n
                raise SwapFullError(
                    f"swap budget exceeded in {self.folder}: writing {n} bytes would put "
                    f"{self.bytes_on_disk + n} bytes on disk, over VB_SWAP_BUDGET={self.budget} bytes"
                )
            self.bytes_on_disk += n - old_n
        try:
            crc = checksum(data)
            if self.direct:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
                try:
                    for off in range(0, n, _CHUNK):
                        m = min(_CHUNK, n - off)
                        padded = _round_up(m)
                        st = self._staging(padded)
                        st[:m] = data[off:off + m]
                        os.pwrite(fd, memoryview(st)[:padded], off)
                    os.ftruncate(fd, n)
                finally:
                    os.close(fd)
            else:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    off = 0
                    while off < n:
                        wrote = os.pwrite(fd, data[off:off + _CHUNK], off)
                        if wrote <= 0:  # never loop forever on a write that makes no progress
                            raise OSError(errno.EIO, f"write of {n} bytes made no progress at byte {off}")
                        off += wrote
                    os.ftruncate(fd, n)
                    os.fdatasync(fd) if hasattr(os, "fdatasync") else os.fsync(fd)
                    _fadvise_dontneed(fd)
                finally:
                    os.close(fd)
        except OSError as err:
            with self._lock:
                self.bytes_on_disk -= n
            try:
                os.unlink(path)
            except OSError:
                pass
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                self.reclaim_stale()  # room for the caller's next attempt
                raise SwapFullError(
                    f"swap directory {self.folder} is full: evicting needs {n} bytes, "
                    f"{self.free_bytes()} bytes free there"
                ) from err
            raise SwapError(f"writing swap file {path} failed: {err}") from err
        rec = SwapRecord(path, n, crc)
        with self._lock:
            self._records[key] = rec
        return rec

    def read_into(self, key: str, out: memoryview) -> None:
        """Read page ``key`` into ``out`` (exactly its size), checking size and checksum.

        Raises:
            SwapCorruptionError: the file is missing, has the wrong size, or its checksum differs.
            SwapError: other I/O failures.
        """
        rec = self._records.get(key)
        if rec is None:
            raise SwapCorruptionError(f"no swap record for page {key!r} in {self.folder}")
        if out.nbytes != rec.nbytes:
            raise SwapError(f"page {key!r}: destination holds {out.nbytes} bytes, the swap file {rec.nbytes}")
        try:
            fd = os.open(rec.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except FileNotFoundError:
            raise SwapCorruptionError(f"swap file {rec.path} is missing") from None
        try:
            size = os.fstat(fd).st_size
            if size != rec.nbytes:
                raise SwapCorruptionError(f"swap file {rec.path} is truncated or altered: {size} bytes, expected {rec.nbytes}")
            for off in range(0, rec.nbytes, _CHUNK):
                m = min(_CHUNK, rec.nbytes - off)
                if self.direct:
                    padded = _round_up(m)
                    st = self._staging(padded)
                    got = os.preadv(fd, [memoryview(st)[:padded]], off)
                    if got < m:
                        raise SwapCorruptionError(f"swap file {rec.path} ended at byte {off + got}, expected {rec.nbytes}")
                    out[off:off + m] = memoryview(st)[:m]
                else:
                    done = 0
                    while done < m:
                        got = os.preadv(fd, [out[off + done:off + m]], off + done)
                        if got <= 0:
                            raise SwapCorruptionError(f"swap file {rec.path} ended at byte {off + done}, expected {rec.nbytes}")
                        done += got
            if not self.direct:
                _fadvise_dontneed(fd)
        except OSError as err:
            if isinstance(err, SwapError):
                raise
            raise SwapError(f"reading swap file {rec.path} failed: {err}") from err
        finally:
            os.close(fd)
        crc = checksum(out)
        if crc != rec.crc:
            raise SwapCorruptionError(
                f"swap file {rec.path} was altered: checksum {crc:#010x}, expected {rec.crc:#010x}; not loaded"
            )

    def has(self, key: str) -> bool:
        return key in self._records

    def remove(self, key: str) -> None:
        """Forget page ``key``'s copy (no error if absent); no system call on the caller's thread.

        The file stays at its size for the page's next write, which overwrites it in place: a
        gradient dropped by ``zero_grad`` every step would otherwise cost a truncate (~0.7 ms,
        measured on ext4) and a re-allocation of its blocks per step. Such stale files count
        against the swap budget (:attr:`stale_bytes`) and are truncated when a write needs the
        room; the whole folder is deleted by :meth:`close`.
        """
        with self._lock:
            rec = self._records.pop(key, None)
            if rec is not None:
                self.bytes_on_disk -= rec.nbytes
                self.stale_bytes += rec.nbytes - self._stale.get(rec.path, 0)
                self._stale[rec.path] = rec.nbytes

    def reclaim_stale(self) -> int:
        """Truncate every stale file (see :meth:`remove`) now; returns the bytes given back."""
        with self._lock:
            return self._reclaim_stale_locked()

    def _reclaim_stale_locked(self) -> int:
        # under self._lock: a write of one of these keys pops its path from _stale under the same
        # lock before touching the file, so no truncate here can hit a file being written
        freed = 0
        for path, nbytes in self._stale.items():
            try:
                os.truncate(path, 0)
                freed += nbytes
            except OSError:
                pass
        self._stale.clear()
        self.stale_bytes = 0
        return freed
