"""The NVMe level: swap folders, verified files, faults, cleanup."""
import errno
import os
import subprocess
import sys
import textwrap
import time

import pytest

from apt_model.errors import ConfigError
from apt_model.memory import swap as swap_mod
from apt_model.memory.swap import SwapCorruptionError, SwapFullError, SwapSpace, clean_stale_folders
from conftest import clean_env


@pytest.fixture(params=["direct", "buffered"])
def space(request, tmp_path):
    s = SwapSpace(tmp_path)
    if request.param == "buffered":
        s.direct = False
    elif not s.direct:
        pytest.skip("this filesystem has no O_DIRECT")
    yield s
    s.close()


def test_round_trip_of_odd_sizes(space):
    for n in (1, 4095, 4096, 4097, 9 * 2**20 + 3):
        data = os.urandom(n)
        rec = space.write(f"k{n}", memoryview(data))
        assert rec.path.stat().st_size == n and rec.nbytes == n
        out = bytearray(n)
        space.read_into(f"k{n}", memoryview(out))
        assert bytes(out) == data
    assert space.bytes_on_disk == sum((1, 4095, 4096, 4097, 9 * 2**20 + 3))


def test_rewrite_in_place_and_remove(space):
    space.write("a", memoryview(b"x" * 5000))
    space.write("a", memoryview(b"y" * 3000))
    out = bytearray(3000)
    space.read_into("a", memoryview(out))
    assert bytes(out) == b"y" * 3000 and space.bytes_on_disk == 3000
    path = space._records["a"].path
    space.remove("a")
    assert space.bytes_on_disk == 0 and not space.has("a")
    assert space.stale_bytes == 3000 and path.stat().st_size == 3000  # left for the next write, counted
    with pytest.raises(SwapCorruptionError, match="no swap record"):
        space.read_into("a", memoryview(bytearray(3000)))
    space.write("a", memoryview(b"z" * 2000))  # the stale file is overwritten in place
    out = bytearray(2000)
    space.read_into("a", memoryview(out))
    assert bytes(out) == b"z" * 2000 and space.stale_bytes == 0 and path.stat().st_size == 2000
    space.remove("a")
    assert space.reclaim_stale() == 2000 and path.stat().st_size == 0 and space.stale_bytes == 0


def test_stale_files_count_against_the_budget_and_are_truncated_for_room(tmp_path):
    s = SwapSpace(tmp_path, budget=10_000)
    try:
        s.write("g", memoryview(b"g" * 6000))
        s.remove("g")  # like a gradient dropped by zero_grad: the file keeps its 6000 bytes
        g_path = s.folder / "g.bin"
        assert g_path.stat().st_size == 6000 and s.stale_bytes == 6000
        s.write("h", memoryview(b"h" * 6000))  # needs the stale room: it is truncated first
        assert g_path.stat().st_size == 0 and s.stale_bytes == 0 and s.bytes_on_disk == 6000
        out = bytearray(6000)
        s.read_into("h", memoryview(out))
        assert bytes(out) == b"h" * 6000
        with pytest.raises(SwapFullError, match="swap budget exceeded"):
            s.write("i", memoryview(b"i" * 5000))
        assert s.bytes_on_disk == 6000 and s.has("h")
    finally:
        s.close()


def test_altered_truncated_and_missing_files_are_refused(space):
    data = os.urandom(10_000)
    rec = space.write("p", memoryview(data))
    with open(rec.path, "r+b") as f:  # flip one byte
        f.seek(1234)
        b = f.read(1)
        f.seek(1234)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(SwapCorruptionError, match=r"was altered: checksum .* not loaded"):
        space.read_into("p", memoryview(bytearray(10_000)))
    space.write("p", memoryview(data))
    os.truncate(rec.path, 9_000)
    with pytest.raises(SwapCorruptionError, match="truncated or altered: 9000 bytes, expected 10000"):
        space.read_into("p", memoryview(bytearray(10_000)))
    space.write("p", memoryview(data))
    os.unlink(rec.path)
    with pytest.raises(SwapCorruptionError, match="is missing"):
        space.read_into("p", memoryview(bytearray(10_000)))


def test_budget_and_disk_full_name_the_folder_and_bytes(tmp_path, monkeypatch):
    s = SwapSpace(tmp_path, budget=8000)
    s.write("a", memoryview(b"1" * 5000))
    with pytest.raises(SwapFullError, match=r"swap budget exceeded .* writing 5000 bytes would put 10000 bytes"):
        s.write("b", memoryview(b"2" * 5000))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(swap_mod.os, "pwrite", full)
    data = bytearray(b"3" * 1000)
    with pytest.raises(SwapFullError) as info:
        s.write("c", memoryview(data))
    assert str(s.folder) in str(info.value) and "needs 1000 bytes" in str(info.value)
    assert data == bytearray(b"3" * 1000) and not s.has("c") and s.bytes_on_disk == 5000
    s.close()


def test_bad_swap_dirs_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        SwapSpace(tmp_path / "nope")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        SwapSpace(f)
    with pytest.raises(ConfigError, match="is not writable"):
        SwapSpace("/proc")


def test_two_spaces_never_share_a_folder_and_close_removes_it(tmp_path):
    a, b = SwapSpace(tmp_path), SwapSpace(tmp_path)
    assert a.folder != b.folder and a.folder.is_dir() and b.folder.is_dir()
    a.write("k", memoryview(b"z" * 10))
    a.close()
    assert not a.folder.exists() and b.folder.exists()
    b.close()


def test_stale_folders_of_dead_processes_are_cleaned_and_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"vb-{dead.pid}-{int(time.time()) - 100}-abcd1234"
    stale.mkdir()
    (stale / "pg1.bin").write_bytes(b"old")
    live = SwapSpace(tmp_path)  # this process: alive
    other = tmp_path / "not-ours"
    other.mkdir()
    assert not stale.exists() and stale in live.stale_removed
    assert clean_stale_folders(tmp_path) == []  # the live folder (this process) is kept
    assert live.folder.exists() and other.exists()
    live.close()


@pytest.mark.parametrize("ending", ["normal", "exception"])
def test_swap_folder_is_removed_at_exit(tmp_path, ending):
    code = textwrap.dedent(f"""
        from apt_model.memory.swap import SwapSpace
        s = SwapSpace({str(tmp_path)!r})
        s.write("k", memoryview(b"q" * 4096))
        print("FOLDER", s.folder, flush=True)
        if {ending!r} == "exception":
            raise RuntimeError("boom")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120)
    folder = proc.stdout.split("FOLDER ", 1)[1].strip()
    assert (proc.returncode != 0) == (ending == "exception")
    assert not os.path.exists(folder)


def test_a_killed_process_leaves_a_folder_that_the_next_one_cleans(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal
        from apt_model.memory.swap import SwapSpace
        s = SwapSpace({str(tmp_path)!r})
        s.write("k", memoryview(b"q" * 4096))
        print("FOLDER", s.folder, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120)
    folder = proc.stdout.split("FOLDER ", 1)[1].strip()
    assert os.path.isdir(folder)  # SIGKILL: no chance to clean up
    nxt = SwapSpace(tmp_path)
    assert not os.path.exists(folder) and any(str(p) == folder for p in nxt.stale_removed)
    nxt.close()


def test_the_wait_limit_comes_from_vb_swap_timeout_and_bad_values_are_named(monkeypatch):
    from apt_model.errors import ConfigError
    from apt_model.memory import waits

    monkeypatch.delenv("VB_SWAP_TIMEOUT", raising=False)
    assert waits.wait_timeout() == waits.DEFAULT_TIMEOUT_S == 120.0
    monkeypatch.setenv("VB_SWAP_TIMEOUT", "2.5")
    assert waits.wait_timeout() == 2.5
    for bad in ("soon", "0", "-3", "inf"):
        monkeypatch.setenv("VB_SWAP_TIMEOUT", bad)
        with pytest.raises(ConfigError, match=rf"VB_SWAP_TIMEOUT='{bad}' is not a number of seconds > 0"):
            waits.wait_timeout()
    assert waits.set_wait_timeout(0.25) is None  # the code's setting wins over the environment
    try:
        assert waits.wait_timeout() == 0.25
        with pytest.raises(ConfigError, match="wait timeout=-1"):
            waits.set_wait_timeout(-1)
    finally:
        waits.set_wait_timeout(None)
    monkeypatch.setenv("VB_SWAP_TIMEOUT", "7")
    assert waits.wait_timeout() == 7.0


def test_a_page_aligned_buffer_moves_in_place_and_only_its_tail_is_staged(tmp_path, monkeypatch):
    """O_DIRECT needs 4 KiB-aligned buffers: an aligned page (torch's huge-page-aligned blocks)
    is written and read straight from its own memory, only the last partial block going through
    the staging buffer; an unaligned one is staged whole. The bytes round-trip either way."""
    import mmap

    space = SwapSpace(tmp_path)
    if not space.direct:
        pytest.skip("the swap folder's filesystem has no O_DIRECT (tmpfs?)")
    staged = []
    real = SwapSpace._staging

    def counting(self, n):
        staged.append(n)
        return real(self, n)

    monkeypatch.setattr(SwapSpace, "_staging", counting)
    n = 3 * 4096 + 100
    aligned = mmap.mmap(-1, 4 * 4096)  # mmap memory is page-aligned
    data = memoryview(aligned)[:n]
    data[:] = os.urandom(n)
    space.write("a", data)
    assert staged == [4096]  # the 100-byte tail, padded to one block
    back = mmap.mmap(-1, 4 * 4096)
    space.read_into("a", memoryview(back)[:n])
    assert staged == [4096, 4096] and bytes(memoryview(back)[:n]) == bytes(data)
    staged.clear()
    unaligned = memoryview(back)[64:64 + n]
    space.read_into("a", unaligned)
    assert bytes(unaligned) == bytes(data) and sum(staged) >= n  # all of it through the staging buffer
    space.close()


@pytest.mark.parametrize("user", [None, "0"])
def test_enable_on_the_cpu_asks_torch_for_aligned_big_blocks_unless_the_user_chose(tmp_path, user):
    code = textwrap.dedent(f"""
        import torch, apt_model.optimization.vb_global as vb
        vb.enable("balanced", paging="over_budget", swap_dir={str(tmp_path)!r}, banner=False, device="cpu")
        t = torch.empty(4 << 20, dtype=torch.uint8)
        from apt_model.switch.controller import session
        print(t.data_ptr() % 4096 == 0, session().stack.describe()["aligned_pages"])
        vb.disable()
    """)
    env = clean_env(**({"THP_MEM_ALLOC_ENABLE": user} if user else {}))
    env.pop("THP_MEM_ALLOC_ENABLE", None) if user is None else None
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == (["True", "True"] if user is None else ["False", "False"])


def test_a_forked_child_neither_removes_the_swap_folder_nor_waits_for_threads_it_lacks(tmp_path):
    """A child made by ``os.fork()`` after paging started runs the same exit handlers: until
    2026-11-26 its normal exit removed the parent's swap folder (the parent's next load found its
    files missing, and its state was lost); a read it asked for waited the whole timeout for I/O
    threads that exist only in the parent. Now the child's exit leaves the folder, and its use of
    the I/O engine fails at once with a ForkedPagingError."""
    from apt_model.memory.io_engine import IOEngine
    from apt_model.memory.swap import ForkedPagingError

    space = SwapSpace(tmp_path)
    engine = IOEngine(readers=1, writers=1)
    space.write("a", memoryview(b"x" * 4096))
    try:
        pid = os.fork()
        if pid == 0:  # the child: close as its atexit would, try a read, report by exit status
            code = 3
            try:
                space.close()
                try:
                    engine.submit_read(4096, lambda: None, "a read").result(timeout=5)
                    code = 1
                except ForkedPagingError as err:
                    code = 0 if "forked" in str(err) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert space.folder.is_dir()
        out = bytearray(4096)
        space.read_into("a", memoryview(out))  # the parent's file is intact
        assert bytes(out) == b"x" * 4096
        assert engine.submit_read(1, lambda: 7, "a read").result(timeout=30) == 7  # the parent's threads serve it
    finally:
        engine.close()
        space.close()
    assert not space.folder.exists()  # the owner's close removes it


FORKED_CHILD = """
import os, sys, time, torch, torch.nn as nn, torch.nn.functional as F
import apt_model.optimization.vb_global as vb
torch.set_num_threads(1)
vb.enable("memory", device="cpu", device_budget="64KB", mixed_precision="off", compile="off",
          swap_dir=sys.argv[1], banner=False)
big = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))  # over the budget: paged
opt = torch.optim.AdamW(big.parameters())
F.cross_entropy(big(torch.randn(8, 64)), torch.zeros(8, dtype=torch.long)).backward()
opt.step()  # page writes are in flight now
pid = os.fork()
if pid == 0:
    status = 1
    try:
        t0 = time.monotonic()
        sd = big.state_dict()  # the parent's model: copies, at once
        saved = time.monotonic() - t0
        torch.manual_seed(1)
        own = nn.Sequential(nn.Linear(8, 2048), nn.Linear(2048, 8))  # the child's own model
        o = torch.optim.SGD(own.parameters(), lr=0.1)
        for _ in range(2):
            own(torch.ones(2, 8)).square().mean().backward(); o.step(); o.zero_grad()
        feats = vb.get_report()["models"][-1]["features"]
        print("CHILD", round(saved, 1), len(sd), feats["paging"]["chosen"], "os.fork()" in feats["paging"]["reason"],
              feats["activation_offload"]["chosen"], own[0].weight.double().sum().item().hex(), flush=True)
        status = 0
    finally:
        os._exit(status)
_, st = os.waitpid(pid, 0)
print("PARENT", os.waitstatus_to_exitcode(st))
vb.disable()
torch.manual_seed(1)
own = nn.Sequential(nn.Linear(8, 2048), nn.Linear(2048, 8))
o = torch.optim.SGD(own.parameters(), lr=0.1)
for _ in range(2):
    own(torch.ones(2, 8)).square().mean().backward(); o.step(); o.zero_grad()
print("PLAIN", own[0].weight.double().sum().item().hex())
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_a_forked_child_trains_a_model_of_its_own_and_saves_the_parents_at_once(tmp_path):
    """Once the parent paged a model, a child made by ``os.fork()`` (a DataLoader worker with its
    own augmentation net, an asynchronous checkpoint writer) could not use a model of its own: it
    was paged through the parent's I/O queues (ForkedPagingError, or VB_SWAP_TIMEOUT waits), and
    the parent's ``state_dict()`` waited VB_SWAP_TIMEOUT for each page whose write was in flight
    at the fork (a probe's findings). The child's own models run as written (no paging, no
    offload: the swap folder is the parent's), and a write in flight fails fast, so state_dict()
    takes copies at once."""
    proc = subprocess.run([sys.executable, "-c", FORKED_CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "VB_CONFIG": "none", "VB_SWAP_TIMEOUT": "20"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line[:5] in ("CHILD", "PAREN", "PLAIN")}
    assert lines["PARENT"] == ["0"], proc.stdout + proc.stderr[-3000:]
    saved_s, entries, paging, says_fork, offload, digest = lines["CHILD"]
    assert float(saved_s) < 5 and entries == "4" and paging == "off" and says_fork == "True" and offload == "off"
    assert digest == lines["PLAIN"][0]


def test_a_relative_swap_dir_survives_a_change_of_working_directory(tmp_path, monkeypatch):
    """``VB_SWAP_DIR=relsw`` and a script that changes directory later (Hydra does): the folder is
    resolved once, so its files are found again (until 2026-11-26 they were reported missing)."""
    (tmp_path / "relsw").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    space = SwapSpace("relsw")
    try:
        assert space.folder.is_absolute() and space.folder.parent == tmp_path / "relsw"
        space.write("a", memoryview(b"y" * 4096))
        monkeypatch.chdir(tmp_path / "elsewhere")
        out = bytearray(4096)
        space.read_into("a", memoryview(out))
        assert bytes(out) == b"y" * 4096
    finally:
        space.close()


@pytest.mark.parametrize("replacement", ["folder", "fifo", "device"])
def test_a_swap_file_replaced_by_no_regular_file_is_a_corruption_error(space, replacement):
    """A folder, or a link to a device, in place of a swap file raised a bare OSError ("Invalid
    argument") that no ``except SwapError`` catches; a FIFO blocked the reader's open forever
    (a probe's finding, 2026-11-29). Each is a SwapCorruptionError naming the file, at once."""
    rec = space.write("p", memoryview(os.urandom(10_000)))
    os.unlink(rec.path)
    if replacement == "folder":
        os.mkdir(rec.path)
    elif replacement == "fifo":
        os.mkfifo(rec.path)
    else:
        os.symlink("/dev/zero", rec.path)
    t0 = time.monotonic()
    with pytest.raises(SwapCorruptionError, match=str(rec.path)):
        space.read_into("p", memoryview(bytearray(10_000)))
    assert time.monotonic() - t0 < 5


def test_a_full_disk_reports_the_room_when_the_write_failed_and_the_settings_to_change(tmp_path, monkeypatch):
    """The free bytes were measured after the failed file and the stale ones were removed, so the
    message could say a write of 32 KiB failed with 556 KiB free; a file-size limit (``ulimit -f``)
    read as a full disk with 84 GB free (a probe's finding). Now the room is read as the write
    failed, the settings are named, and a file-size limit is said to be one."""
    s = SwapSpace(tmp_path)
    monkeypatch.setattr(s, "free_bytes", lambda: 777)

    def fail(code):
        def pwrite(*a, **k):
            raise OSError(code, os.strerror(code))
        return pwrite

    monkeypatch.setattr(swap_mod.os, "pwrite", fail(errno.ENOSPC))
    with pytest.raises(SwapFullError, match=r"needs 1000 bytes, 777 bytes were free there when it failed.*VB_SWAP_DIR"):
        s.write("c", memoryview(bytearray(1000)))
    monkeypatch.setattr(swap_mod.os, "pwrite", fail(errno.EFBIG))
    with pytest.raises(SwapFullError, match=r"file-size limit \(ulimit -f, RLIMIT_FSIZE\)"):
        s.write("c", memoryview(bytearray(1000)))
    monkeypatch.undo()
    s.close()


def test_the_default_swap_dir_is_one_per_user_and_other_users_folders_are_left_alone(tmp_path, monkeypatch):
    """One default folder for every user was made by the first, writable by that user only: every
    other user's ``enable()`` raised ConfigError, even where nothing would page. And in a shared
    swap dir, another user's folder (mode 700) made the stale-folder scan raise PermissionError
    out of ``enable()`` (a probe's finding, 2026-11-29)."""
    monkeypatch.delenv("VB_SWAP_DIR", raising=False)
    assert swap_mod.default_swap_root().name == f"apt_model-swap-{os.getuid()}"
    theirs = tmp_path / f"vb-{os.getpid()}-1-abcd1234"
    theirs.mkdir()
    real_exists = swap_mod.Path.exists

    def exists(self, *a, **k):  # what a folder another user keeps at mode 700 answers (root reads anything)
        if self.parent == theirs:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_exists(self, *a, **k)

    monkeypatch.setattr(swap_mod.Path, "exists", exists)
    assert clean_stale_folders(tmp_path) == []
    assert real_exists(theirs)  # kept: not ours to judge


STUCK_READ = r"""
import os, sys, time, threading, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
import apt_model.optimization.vb_global as vb
from apt_model.memory import swap as swap_mod
from apt_model.memory.swap import SwapTimeoutError
vb.enable("balanced", paging="always", device_budget="16KB", attention="off", mixed_precision="off",
          compile="off", banner=False, swap_dir=sys.argv[1], paging_step_in_backward="off")
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
opt = torch.optim.AdamW(m.parameters())
def step():
    opt.zero_grad(); F.mse_loss(m(torch.randn(8, 32)), torch.randn(8, 32)).backward(); opt.step()
step()
swap_mod.SwapSpace.read_into = lambda self, key, out: threading.Event().wait()  # a disk that stops answering
try:
    step()
except SwapTimeoutError as err:
    print("TIMEOUT", flush=True)
t0 = time.monotonic()
try:
    vb.disable()
except Exception as err:
    print("DISABLE", type(err).__name__, flush=True)
print(f"DISABLED_IN {time.monotonic() - t0:.1f}", flush=True)
"""


def test_a_read_that_never_returns_neither_keeps_the_process_alive_nor_makes_disable_wait_per_page(tmp_path):
    """A read stuck in the kernel (a stalled network mount): the SwapTimeoutError came on time, but
    the process could never exit (ThreadPoolExecutor joins its workers at exit) and ``disable()``
    waited the limit again for every page (a probe's finding, 2026-11-29). The I/O threads are
    daemon threads now, and once every reader is stuck past the limit, waits give up at once."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_READ)
    (tmp_path / "swap").mkdir()
    env = {**clean_env(), "VB_DEVICE": "cpu", "VB_CONFIG": "none", "VB_SWAP_TIMEOUT": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "swap")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert "TIMEOUT" in proc.stdout, proc.stdout + proc.stderr
    took = float(proc.stdout.split("DISABLED_IN ")[1].split()[0])
    assert took < 6, proc.stdout  # a few waits of the 1 s limit at most, not one per page
    assert proc.returncode == 0, proc.stderr[-2000:]
