"""The NVMe level: swap files in a per-process folder, verified on every read.

* Each process gets its own folder ``<swap dir>/vb-<pid>-<process start>-<random>``, created
  exclusively, so two processes never share swap files.
* **Ownership is a lock, not a PID.** The folder is built under a temporary name, with an
  exclusive ``flock`` on its ``.owner.lock`` file taken before it is renamed into place; the lock
  is held (one open file descriptor) for the folder's whole life and the kernel drops it when the
  process dies, however it dies. Another process — in another PID namespace too (containers
  sharing a swap volume), where the owner's PID means nothing — removes a folder only after taking
  that lock itself. Where the filesystem refuses ``flock``, the ``.owner`` marker (boot id, PID
  namespace, PID and start time) decides, and a folder owned from another PID namespace of the
  same boot is left alone. Only folders from versions without either file fall back to the PID.
* The folder is removed at normal interpreter exit and after an uncaught exception (``atexit``),
  and when the :class:`SwapSpace` is closed — unless :meth:`SwapSpace.retain` marked it as holding
  bytes that could not be brought back (see :class:`PagingRecoveryError`): then it is kept with a
  ``RECOVERY.txt`` saying what is in it, and no cleanup ever removes it. Folders left by a process
  that died (SIGKILL, power loss) are removed by the next :class:`SwapSpace` opened on the same
  swap dir.
* Page versions: :meth:`SwapSpace.rename` moves a record to another key without touching its file,
  and a write never reuses a file another record still holds — so a page's previous version can be
  kept beside the new one until an optimizer step commits (see the pager's step transactions).
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
import ctypes
import errno
import fcntl
import json
import mmap
import os
import re
import resource
import secrets
import shutil
import stat
import tempfile
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path

import psutil

from apt_model.base.errors import ConfigError, VBError
from apt_model.base.log import get_logger
from apt_model.base.settings import read_env
from apt_model.memory.settings import SWAP_DIR
from apt_model.memory.waits import TimedLock

log = get_logger(__name__)

try:
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - the package is a declared dependency
    _crc32c = None

_FOLDER = re.compile(r"^vb-(\d+)-(\d+)-[0-9a-f]+$")
_BUILDING = re.compile(r"^\.vb-new-\d+-[0-9a-f]+$")  # a folder being created (renamed into place once locked)
LOCK_FILE = ".owner.lock"
OWNER_FILE = ".owner"
RECOVERY_FILE = "RECOVERY.txt"
_BUILD_GRACE_S = 600  # a ".vb-new-*" folder younger than this may be locked by its builder any moment
_CHUNK = 8 << 20  # bytes per I/O call (a multiple of the 4 KiB O_DIRECT alignment)
_ALIGN = 4096


def checksum(data, value: int = 0) -> int:
    """CRC-32C of ``data`` (continuing ``value``); zlib's CRC-32 if ``crc32c`` is missing."""
    return _crc32c(data, value) if _crc32c is not None else zlib.crc32(data, value)


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _aligned_prefix(buf: memoryview) -> int:
    """How many leading bytes of ``buf`` O_DIRECT can move in place: all its whole 4 KiB blocks
    when its address is 4 KiB-aligned (a page allocated with huge-page alignment, e.g. under
    ``THP_MEM_ALLOC_ENABLE=1``), else 0 (everything goes through the staging buffer)."""
    n = buf.nbytes
    if n < _ALIGN or buf.readonly:
        return 0
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return 0 if addr % _ALIGN else n // _ALIGN * _ALIGN


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


class PagingRecoveryError(SwapError):
    """Paged tensors whose bytes could not be brought back into memory (a corrupt, missing or
    unreadable swap file, a read that never finished).

    Raised by ``vb.disable()`` after everything else *was* brought back, and by an optimizer step
    whose roll-back could not restore some tensors. The lost tensors are not left with 0-byte
    storage: they get memory again, filled with NaN (integer tensors: zeros), so using one by
    mistake shows at once. The swap folder is kept, with a ``RECOVERY.txt`` naming each lost
    tensor and its file, and is never removed by the stale-folder cleanup (delete it yourself).

    Attributes:
        lost: ``{tensor label: why}`` for every tensor that could not be restored.
        folder: the swap folder kept for inspection (None if there is none).
    """

    def __init__(self, message: str, lost: dict | None = None, folder: Path | None = None):
        super().__init__(message)
        self.lost = dict(lost or {})
        self.folder = folder


class ForkedPagingError(SwapError):
    """A process made by ``os.fork()`` after paging started used the paged state: its swap I/O
    threads exist only in the parent (a fork copies the calling thread alone), so paging cannot
    serve the child. The parent's paging is untouched; the child's exit no longer removes the
    parent's swap folder (until 2026-11-26 it did, and the parent's state was lost)."""


#: Why a model adopted in a process forked from the one that owns the memory stack gets no paging
#: and no activation offload (the swap folder and the I/O threads serving it are the parent's).
FORKED_CHILD_REASON = (
    "this process was made by os.fork() from the one that owns the memory stack (its swap folder and I/O "
    "threads are the parent's): the model runs as written here, unpaged and not offloaded (until 2026-11-28 "
    "it went through the parent's I/O queues and failed with ForkedPagingError or waited VB_SWAP_TIMEOUT)")


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
    """``$VB_SWAP_DIR``, or ``<system temp>/apt_model-swap-<user id>``: one per user. A folder
    shared by every user was made by the first one, writable by that user only, and every other
    user's ``enable()`` then raised ConfigError ("not writable"), even in modes that never page (a
    probe's finding, 2026-11-29)."""
    found = read_env(SWAP_DIR)
    if found is not None:
        return Path(found[0])
    return Path(tempfile.gettempdir()) / swap_folder_name()


def swap_folder_name() -> str:
    """``apt_model-swap-<user id>``: the name of this user's swap dir inside a shared folder (the
    system temp folder, or the disk ``apt-vb suggest`` picks)."""
    return f"apt_model-swap-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _process_start(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def owner_identity() -> dict:
    """This process as a folder owner: ``{"boot_id", "pid_ns", "pid", "start"}`` (boot id and PID
    namespace are None where ``/proc`` does not say). A PID alone names a process only within one
    PID namespace of one boot; the triple names it everywhere the folder can be seen from."""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns, "pid": os.getpid(),
            "start": _process_start(os.getpid())}


def _try_lock(fd: int) -> bool | None:
    """Exclusive non-blocking ``flock`` on ``fd``: True (taken), False (held by a live owner), None
    (the filesystem does not support ``flock``)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None  # ENOLCK, EOPNOTSUPP, EINVAL: no flock here


def _owner_gone_by_marker(folder: Path, name_match) -> tuple[bool, str]:
    """(whether the folder's owner is certainly gone, why), from its ``.owner`` marker, or from its
    name for folders of versions that wrote neither lock nor marker."""
    me = owner_identity()
    raw = _read_text(str(folder / OWNER_FILE))
    if raw is not None:
        try:
            owner = json.loads(raw)
        except ValueError:
            return False, "its owner marker is unreadable"
        if owner.get("boot_id") and me["boot_id"] and owner["boot_id"] != me["boot_id"]:
            return True, "its owner ran before the last reboot"
        if owner.get("pid_ns") != me["pid_ns"] or owner.get("pid_ns") is None:
            return False, "its owner runs in another PID namespace, where its PID means nothing here"
        pid, start = owner.get("pid"), owner.get("start")
    elif name_match is not None:  # no lock, no marker: an older version's folder
        pid, start = int(name_match.group(1)), int(name_match.group(2))
    else:
        return False, "it has no owner lock or marker yet"
    if not isinstance(pid, int):
        return False, "its owner marker names no process"
    alive = psutil.pid_exists(pid) and (start is None or _process_start(pid) == start)
    return (not alive), f"process {pid} is {'alive' if alive else 'gone'}"


def clean_stale_folders(root: Path) -> list[Path]:
    """Remove the swap folders under ``root`` whose owner is gone; returns what was removed.

    A folder is removed only after this process took its owner lock (``.owner.lock``: free once
    the owner died, in whatever PID namespace it ran) — or, on a filesystem without ``flock``,
    when its owner marker says the owner is gone (another boot, or a dead process of this PID
    namespace). Folders kept for inspection (``RECOVERY.txt``) are never removed.
    """
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _FOLDER.match(entry.name)
        if (m is None and not _BUILDING.match(entry.name)) or not entry.is_dir():
            continue
        try:
            kept = (entry / RECOVERY_FILE).exists()
        except OSError:  # another user's folder (mode 700) in a shared swap dir: not ours to judge
            continue
        if kept:
            log.info("swap folder %s is kept for inspection (%s); delete it once you are done with it",
                     entry, RECOVERY_FILE)
            continue
        fd = None
        try:
            try:
                fd = os.open(entry / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = None
            except OSError:
                continue  # cannot tell: keep it
            if m is None and time.time() - entry.stat().st_mtime < _BUILD_GRACE_S:
                continue  # another process may be locking it right now
            locked = _try_lock(fd) if fd is not None else None
            if locked is False:
                continue  # its owner is alive (and holds the lock), whatever its PID looks like from here
            if locked is True:
                why = "its owner's lock is free"
            elif m is None:
                continue  # being built, or built on a filesystem without flock: not ours to judge
            else:
                gone, why = _owner_gone_by_marker(entry, m)
                if not gone:
                    continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            log.info("removed swap folder %s left by a process that is gone (%s)", entry, why)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


class _Owner:
    """This process's hold on its swap folder: the locked descriptor, and whether the folder must
    be kept. Separate from :class:`SwapSpace` so the finalizer can use it without the space."""

    def __init__(self, folder: Path, fd: int | None):
        self.folder = folder
        self.fd = fd
        self.keep = False
        self.pid = os.getpid()  # a child made by os.fork() runs the same atexit/finalizer: it is no owner

    def release(self) -> None:
        """Delete the folder (unless it is kept), then drop the lock; in a forked child, only
        close the child's copy of the lock descriptor (the parent keeps the lock and the folder)."""
        if not self.keep and os.getpid() == self.pid:
            shutil.rmtree(self.folder, ignore_errors=True)
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def _create_owned_folder(root: Path, name: str) -> tuple[Path, int | None]:
    """Create ``root/name`` already locked: built as ``.vb-new-*`` with its lock taken and its owner
    marker written, then renamed into place, so no other process ever sees it unlocked.

    Raises:
        OSError: the folder cannot be created or written.
    """
    tmp = root / f".vb-new-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700)
    fd = None
    try:
        # read-only: flock needs no more, and a read-only remount of the disk stays possible
        fd = os.open(tmp / LOCK_FILE, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if _try_lock(fd) is None:
            log.debug("no flock on %s: the owner marker decides who owns the swap folder", root)
        (tmp / OWNER_FILE).write_text(json.dumps(owner_identity()))
        final = root / name
        os.rename(tmp, final)
        return final, fd
    except BaseException:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
        explicit = root is not None or read_env(SWAP_DIR) is not None
        # absolute: a script that changes its working directory later (Hydra does) must find its files
        self.root = Path(os.path.abspath(root)) if root is not None else default_swap_root()
        if not self.root.exists():
            if explicit:
                raise ConfigError(f"swap directory {str(self.root)!r} does not exist; create it or set VB_SWAP_DIR to a folder that does")
            try:
                self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as err:
                raise ConfigError(f"the default swap directory {str(self.root)!r} could not be made: "
                                  f"{err.strerror or err}; set swap_dir / VB_SWAP_DIR to a writable folder") from None
        if not self.root.is_dir():
            raise ConfigError(f"swap directory {str(self.root)!r} is not a folder")
        self.stale_removed = clean_stale_folders(self.root)
        start = _process_start(os.getpid()) or int(time.time())
        name = f"vb-{os.getpid()}-{start}-{secrets.token_hex(4)}"
        try:
            self.folder, lock_fd = _create_owned_folder(self.root, name)
        except OSError as err:
            raise ConfigError(f"swap directory {str(self.root)!r} is not writable: {err.strerror or err}; set "
                              "swap_dir / VB_SWAP_DIR to a folder this user can write") from None
        self._owner = _Owner(self.folder, lock_fd)
        self.budget = budget
        self.direct = supports_direct_io(self.folder)
        self._tls = threading.local()
        self._staged: dict[int, int] = {}  # thread id -> bytes of its staging buffer touched so far (RSS)
        self.bytes_on_disk = 0
        self._records: dict[str, SwapRecord] = {}
        # files of removed pages, left at their size for the page's next write (path -> bytes);
        # counted against the budget and truncated when room is needed (see remove())
        self._stale: dict[Path, int] = {}
        self.stale_bytes = 0
        self._lock = TimedLock(f"swap folder {self.folder}")
        self._closed = False
        self._release_pending = False  # close() was cut short inside the folder's deletion
        self._finalizer = weakref.finalize(self, self._owner.release)

    def forked(self) -> bool:
        """Whether this process was made by ``os.fork()`` after the folder was claimed: the folder,
        its files and the I/O threads serving them are the parent's."""
        return os.getpid() != self._owner.pid
        atexit.register(self.close)

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Delete this process's swap folder and everything in it — unless :meth:`retain` kept it
        (then only the owner lock is dropped, and the folder stays for inspection)."""
        if self._closed and not self._release_pending:
            return
        self._closed = True
        self._finalizer.detach()  # released here, not by the finalizer: a release cut short is retried
        self._release_pending = True
        self._owner.release()  # an interrupt inside the deletion: the next close(), or the exit's, finishes it
        self._release_pending = False
        if not self._owner.keep:  # the folder and its files are gone: the counters and records say so
            with self._lock:  # (a remove() after this finds nothing: it drove the counters negative)
                self.bytes_on_disk = 0
                self.stale_bytes = 0
                self._records.clear()
                self._stale.clear()
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001
            pass

    def retain(self, lost: dict[str, str]) -> Path:
        """Keep this folder when the space closes, because it holds the only copies of ``lost``
        (``{tensor label: file and why it could not be read}``): a ``RECOVERY.txt`` in it says so,
        and the stale-folder cleanup of later processes leaves it alone. Returns the folder."""
        self._owner.keep = True
        lines = ["This swap folder was kept because some paged tensors could not be brought back into memory.",
                 "Their last bytes, if any, are in the files named below; delete the folder when you are done.", ""]
        lines += [f"{label}: {why}" for label, why in lost.items()]
        try:
            (self.folder / RECOVERY_FILE).write_text("\n".join(lines) + "\n")
        except OSError as err:
            log.warning("could not write %s in %s: %s", RECOVERY_FILE, self.folder, err)
        return self.folder

    @property
    def retained(self) -> bool:
        """Whether :meth:`retain` marked the folder to be kept."""
        return self._owner.keep

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
        me = threading.get_ident()
        if n > self._staged.get(me, 0):  # its pages stay resident once touched
            self._staged[me] = min(n, len(buf))
        return buf

    @property
    def staging_bytes(self) -> int:
        """Resident bytes of the I/O threads' O_DIRECT staging buffers (0 without O_DIRECT): each
        thread's buffer, as far as it was touched — up to 8 MiB (one I/O call) per thread."""
        return sum(self._staged.values())

    def _path_for(self, key: str, old: SwapRecord | None) -> Path:
        """The file for a new write of ``key``: its previous file (overwritten in place), else the
        first of ``<key>.bin``, ``<key>.1.bin``... that no other record holds (a renamed record —
        a page's previous version kept until its step commits — keeps its file). Under the lock."""
        if old is not None:
            return old.path
        held = {r.path for r in self._records.values()}
        i = 0
        while True:
            path = self.folder / (f"{key}.bin" if i == 0 else f"{key}.{i}.bin")
            if path not in held:
                return path
            i += 1

    def write(self, key: str, data: memoryview) -> SwapRecord:
        """Write ``data`` (bytes) as the page ``key``; returns its record.

        The previous record of ``key`` is invalidated first: if this write fails, the page has no
        valid copy on disk, and its caller keeps the bytes in memory (dirty). A record renamed
        away from ``key`` (:meth:`rename`) keeps its file: this write goes to another one.

        Raises:
            SwapFullError: the disk is full or the swap budget would be exceeded (``data`` is
                untouched); the message names the folder, the page and the bytes needed.
            SwapError: other I/O failures (a read-only filesystem...).
        """
        n = data.nbytes
        with self._lock:
            old = self._records.pop(key, None)
            path = self._path_for(key, old)
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
                    f"swap budget exceeded in {self.folder}: writing {n} bytes would put {self.bytes_on_disk + n} "
                    f"bytes on disk, over the swap budget of {self.budget} bytes (swap_budget / VB_SWAP_BUDGET; writing {key})"
                )
            self.bytes_on_disk += n - old_n
        try:
            crc = checksum(data)
            if self.direct:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
                try:
                    direct = _aligned_prefix(data)  # straight from the tensor's memory, no staging copy
                    for off in range(0, direct, _CHUNK):
                        part = data[off:min(off + _CHUNK, direct)]
                        if os.pwrite(fd, part, off) != part.nbytes:  # a regular file's short write: no room
                            raise OSError(errno.ENOSPC, f"short write of {part.nbytes} bytes at byte {off}")
                    for off in range(direct, n, _CHUNK):
                        m = min(_CHUNK, n - off)
                        padded = _round_up(m)
                        st = self._staging(padded)
                        st[:m] = data[off:off + m]
                        if os.pwrite(fd, memoryview(st)[:padded], off) != padded:
                            raise OSError(errno.ENOSPC, f"short write of {padded} bytes at byte {off}")
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
            free = self.free_bytes()  # as the write met it: before this file and stale ones go
            with self._lock:
                self.bytes_on_disk -= n
            try:
                os.unlink(path)
            except OSError:
                pass
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                self.reclaim_stale()  # room for the caller's next attempt
                raise SwapFullError(
                    f"swap directory {self.folder} is full: writing {key} needs {n} bytes, {free} bytes were free "
                    "there when it failed; free space on that disk, or point swap_dir / VB_SWAP_DIR at a larger "
                    "one (swap_budget / VB_SWAP_BUDGET caps what paging puts there)"
                ) from err
            if err.errno == errno.EFBIG or (err.errno == errno.EINVAL and self._over_file_size_limit(n)):
                limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
                raise SwapFullError(
                    f"writing swap file {path} ({n} bytes) failed: {err.strerror or err}; this process's file-size "
                    f"limit (ulimit -f, RLIMIT_FSIZE) is {limit} bytes: raise it, or lower the page size"
                ) from err
            raise SwapError(f"writing swap file {path} failed: {err}") from err
        rec = SwapRecord(path, n, crc)
        with self._lock:
            self._records[key] = rec
        return rec

    def rename(self, key: str, new_key: str) -> bool:
        """Move ``key``'s record to ``new_key`` (its file stays where it is; a record ``new_key``
        had before is dropped, its file left stale). Returns False if ``key`` has no record."""
        with self._lock:
            rec = self._records.pop(key, None)
            if rec is None:
                return False
            self._drop_record_locked(new_key)
            self._records[new_key] = rec
            return True

    def record(self, key: str) -> SwapRecord | None:
        """``key``'s record (path, bytes, CRC), or None."""
        return self._records.get(key)

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
        # O_NONBLOCK: a FIFO put in place of the file would block the open forever (no effect on a
        # regular file). The open's other errors name the file as altered: a folder, or a link to a
        # device, in its place failed with a bare OSError ("Invalid argument"), no SwapError a
        # script could catch (a probe's finding, 2026-11-29)
        try:
            fd = os.open(rec.path, os.O_RDONLY | os.O_NONBLOCK | (os.O_DIRECT if self.direct else 0))
        except FileNotFoundError:
            raise SwapCorruptionError(f"swap file {rec.path} is missing") from None
        except OSError as err:
            kind = SwapCorruptionError if err.errno in (errno.EINVAL, errno.EISDIR, errno.ELOOP) else SwapError
            raise kind(f"swap file {rec.path} of page {key!r} could not be opened ({err.strerror or err}): "
                       "it was replaced or altered, or the disk failed") from err
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SwapCorruptionError(f"swap file {rec.path} of page {key!r} was replaced: it is no regular "
                                          "file now (a folder, a FIFO or a device)")
            size = st.st_size
            if size != rec.nbytes:
                raise SwapCorruptionError(f"swap file {rec.path} is truncated or altered: {size} bytes, expected {rec.nbytes}")
            direct = _aligned_prefix(out) if self.direct else 0  # straight into the tensor's memory
            for off in range(0, direct, _CHUNK):
                m = min(_CHUNK, direct - off)
                got = os.preadv(fd, [out[off:off + m]], off)
                if got < m:
                    raise SwapCorruptionError(f"swap file {rec.path} ended at byte {off + got}, expected {rec.nbytes}")
            for off in range(direct, rec.nbytes, _CHUNK):
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

    @staticmethod
    def _over_file_size_limit(nbytes: int) -> bool:
        """Whether a write of ``nbytes`` (rounded up to the O_DIRECT block, as direct writes are)
        passes this process's file-size limit (``RLIMIT_FSIZE``). A direct write past a limit that is
        no multiple of the block fails with EINVAL, not EFBIG."""
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        return soft != resource.RLIM_INFINITY and _round_up(nbytes) > soft

    def remove(self, key: str) -> None:
        """Forget page ``key``'s copy (no error if absent); no system call on the caller's thread.

        The file stays at its size for the page's next write, which overwrites it in place: a
        gradient dropped by ``zero_grad`` every step would otherwise cost a truncate (~0.7 ms,
        measured on ext4) and a re-allocation of its blocks per step. Such stale files count
        against the swap budget (:attr:`stale_bytes`) and are truncated when a write needs the
        room; the whole folder is deleted by :meth:`close`.
        """
        with self._lock:
            self._drop_record_locked(key)

    def delete(self, key: str) -> None:
        """Forget page ``key``'s copy and delete its files: for a page gone for good (its tensor
        was garbage-collected, or it is no longer paged), whose key is never written again.
        :meth:`remove` would leave the file for a next write that never comes, so a script that
        drops model after model would fill the folder. A file another record holds (a renamed
        version, see :meth:`rename`) stays. One ``unlink`` per file on the caller's thread.

        Runs for every pre-step copy a step drops, so it looks up the key's own files rather than
        scanning the folder's records: ``<key>.bin``, and ``<key>.1.bin`` (written while the
        key's previous version, renamed for a roll-back, held the first; see :meth:`_path_for`)."""
        with self._lock:
            rec = self._records.get(key)
            self._drop_record_locked(key)  # its file, if any, is stale now
            mine = {self.folder / f"{key}.bin", self.folder / f"{key}.1.bin"}
            if rec is not None:
                mine.add(rec.path)
            for path in mine:
                if path not in self._stale:  # no file, or one a renamed record holds
                    continue
                self.stale_bytes -= self._stale.pop(path)
                try:
                    path.unlink()
                except OSError:  # gone already, or the folder is read-only: close() removes it
                    pass

    def _drop_record_locked(self, key: str) -> None:
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
