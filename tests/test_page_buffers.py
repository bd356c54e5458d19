"""Free page buffers: evicted pages' memory reused by the next load of the same size, within the budget."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.memory.page_buffers import FreePageBuffers, supported

pytestmark = pytest.mark.skipif(not supported(), reason="this torch has no UntypedStorage._swap_data_ptr_")

MiB = 2**20


def filled(nbytes, value):
    t = torch.full((nbytes // 4,), float(value))
    return t, t.untyped_storage()


def test_kept_memory_is_handed_to_the_next_storage_of_its_size_without_a_copy():
    bufs = FreePageBuffers(min_bytes=MiB)
    t, st = filled(2 * MiB, 7)
    ptr = st.data_ptr()
    assert bufs.keep(st, limit=4 * MiB)
    assert st.nbytes() == 0 and t.untyped_storage().nbytes() == 0  # as resize_(0): the view has no bytes
    assert bufs.held == 2 * MiB

    u = torch.empty(0)
    other = u.untyped_storage()
    assert bufs.take(other, 2 * MiB)
    assert other.data_ptr() == ptr  # the same memory, not a copy
    assert torch.all(u.set_(other, 0, (MiB // 2,), (1,)) == 7)  # stale bytes: the loader overwrites them
    assert bufs.held == 0 and (bufs.hits, bufs.misses, bufs.kept) == (1, 0, 1)


def test_a_view_of_the_page_sees_the_memory_it_is_given():
    bufs = FreePageBuffers(min_bytes=MiB)
    _, donor = filled(MiB, 3)
    page, st = filled(MiB, 1)
    view = page[10:20]
    st.resize_(0)  # the page was evicted
    assert bufs.keep(donor, limit=MiB)
    assert bufs.take(st, MiB)
    assert torch.all(view == 3) and view.untyped_storage().data_ptr() == st.data_ptr()


def test_sizes_limits_and_small_blocks():
    bufs = FreePageBuffers(min_bytes=MiB)
    _, a = filled(2 * MiB, 1)
    assert not bufs.keep(a, limit=MiB)  # over the limit: the caller frees it
    assert a.nbytes() == 2 * MiB
    _, small = filled(MiB // 2, 1)
    assert not bufs.keep(small, limit=10 * MiB)  # below min_bytes: glibc's heap reuses those already
    assert bufs.keep(a, limit=2 * MiB)
    empty = torch.empty(0).untyped_storage()
    assert not bufs.take(empty, 3 * MiB)  # no buffer of that size
    assert empty.nbytes() == 0 and bufs.misses == 1
    full = torch.empty(MiB // 4).untyped_storage()
    assert not bufs.take(full, 2 * MiB)  # only an empty storage takes a buffer
    assert bufs.held == 2 * MiB


def test_a_storage_exported_to_numpy_is_not_kept():
    bufs = FreePageBuffers(min_bytes=MiB)
    t, st = filled(MiB, 1)
    arr = t.numpy()  # fixes the storage's size for good
    assert not st.resizable()
    assert not bufs.keep(st, limit=4 * MiB)
    assert st.nbytes() == MiB and np.all(arr == 1)


def test_shrink_drops_the_largest_sizes_first_down_to_the_limit():
    bufs = FreePageBuffers(min_bytes=MiB)
    for n in (MiB, 4 * MiB, 2 * MiB, MiB):
        assert bufs.keep(filled(n, 0)[1], limit=100 * MiB)
    assert bufs.held == 8 * MiB
    bufs.shrink(3 * MiB)
    assert bufs.held == 2 * MiB and bufs.dropped == 2  # 4 MiB then 2 MiB went; both 1 MiB stay
    assert bufs.take(torch.empty(0).untyped_storage(), MiB)
    assert not bufs.take(torch.empty(0).untyped_storage(), 2 * MiB)
    bufs.clear()
    assert bufs.held == 0
    with pytest.raises(ValueError, match="min_bytes"):
        FreePageBuffers(min_bytes=0)


def _train(m, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 512, generator=gen)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(m(x), x).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])  # 1 MiB weights


def test_paged_training_reuses_page_memory_bitwise_and_within_the_budget(tmp_path):
    """Pages of 1 MiB (weights, their gradients and Adam states: 16 MiB of state under 5 MB):
    loads are served from evicted pages' memory, training stays bitwise that of plain training,
    and pages plus the buffers held never take more than the budget (plus the excess a forced
    plan is allowed, counted apart)."""
    plain = _mlp()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    _train(plain, plain_opt, 4)

    vb.enable("balanced", paging="always", device_budget="5MB", swap_dir=str(tmp_path), mixed_precision="off",
              attention="off", banner=False)
    try:
        m = _mlp()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        _train(m, opt, 4)
        level0 = vb.get_stats()["levels"][0]
        paged_sd = {k: v.clone() for k, v in m.state_dict().items()}
        paged_state = [{k: v.clone() for k, v in opt.state[p].items()} for p in m.parameters()]
    finally:
        vb.disable()
    for k, v in plain.state_dict().items():
        assert torch.equal(v, paged_sd[k]), k
    for p, st in zip(plain.parameters(), paged_state):
        for k, v in plain_opt.state[p].items():
            assert torch.equal(v, st[k]), k

    bufs = level0["free_page_buffers"]
    assert bufs["hits"] > 0 and bufs["kept"] > 0, bufs
    assert bufs["hits"] >= bufs["misses"], bufs  # most 1 MiB loads found one
    assert level0["peak_with_free_buffers"] <= level0["capacity"] + level0["over_budget_bytes"], level0


def test_the_setting_turns_reuse_off(tmp_path, monkeypatch):
    monkeypatch.setenv("VB_PAGING_REUSE_MEMORY", "0")
    vb.enable("balanced", paging="always", device_budget="5MB", swap_dir=str(tmp_path), mixed_precision="off",
              attention="off", banner=False)
    try:
        m = _mlp()
        _train(m, torch.optim.AdamW(m.parameters(), lr=1e-3), 2)
        level0 = vb.get_stats()["levels"][0]
    finally:
        vb.disable()
    assert level0["misses"] > 0 and "free_page_buffers" not in level0


def _pager(tmp_path, budget):
    from apt_model.memory.pager import Pager
    from apt_model.memory.swap import SwapSpace

    return Pager(budget, SwapSpace(str(tmp_path)))


def _tensors(n, first=0):
    return [torch.full((MiB // 4,), float(first + i)) for i in range(n)]


def test_new_tensors_and_a_lower_budget_make_buffers_give_way(tmp_path):
    """Gradients and states arrive by ``register`` (torch created them): buffers give way to them,
    and to a budget lowered later (the session does when the plan keeps state resident)."""
    from apt_model.memory.pages import Category

    pager = _pager(tmp_path, 4 * MiB)
    try:
        ts = _tensors(4)
        pages = [pager.register(Category.PARAM, (lambda t=t: t), f"p{i}") for i, t in enumerate(ts)]
        pager.evict_now(pages[:3])
        pager.flush()
        assert pager.buffers.held == 3 * MiB and pager.resident_bytes == MiB
        grads = _tensors(2, 10)
        for i, g in enumerate(grads):
            pager.register(Category.GRAD, (lambda g=g: g), f"g{i}")
        assert pager.resident_bytes + pager.buffers.held <= pager.budget
        assert pager.stats.peak_with_free_buffers <= 4 * MiB
        pager.budget = 3 * MiB
        assert pager.buffers.held == 0
    finally:
        pager.close()


def test_a_page_of_a_size_not_held_gets_fresh_memory_only_after_buffers_gave_way(tmp_path, monkeypatch):
    import apt_model.memory.pager as pager_mod
    from apt_model.memory.pages import Category

    pager = _pager(tmp_path, 4 * MiB)
    big = torch.ones(3 * MiB // 4)
    try:
        page = pager.register(Category.PARAM, lambda: big, "big")
        pager.evict_now([page])
        pager.flush()
        pager.buffers.clear()
        for _ in range(2):  # two 1 MiB buffers: no 3 MiB one
            assert pager.buffers.keep(torch.ones(MiB // 4).untyped_storage(), pager.budget - pager.resident_bytes)
        seen = []
        real = pager_mod.alloc_storage

        def alloc(storage, nbytes):
            seen.append(pager.buffers.held + pager.resident_bytes + nbytes)
            real(storage, nbytes)

        monkeypatch.setattr(pager_mod, "alloc_storage", alloc)
        pager.acquire([page])
        assert seen and max(seen) <= 4 * MiB, seen
        assert torch.all(big == 1)
        pager.release([page])
    finally:
        pager.close()


def test_a_read_that_times_out_and_then_fails_leaves_nan_not_another_pages_bytes(tmp_path, monkeypatch):
    import time

    from apt_model.memory.pages import Category
    from apt_model.memory.swap import PagingRecoveryError
    from apt_model.memory.waits import set_wait_timeout

    pager = _pager(tmp_path, 4 * MiB)
    a, b = torch.full((MiB // 4,), 1.0), torch.full((MiB // 4,), 2.0)
    pa = pager.register(Category.PARAM, lambda: a, "A")
    pb = pager.register(Category.PARAM, lambda: b, "B")
    pager.evict_now([pb])
    pager.flush()
    pager.evict_now([pa])
    pager.flush()  # A's memory is now a buffer B's load will take
    real = pager.swap.read_into
    failed = []

    def hanging_read(key, out):
        if key == pb.key:
            time.sleep(1.0)
            failed.append(key)
            raise OSError(5, "Input/output error")
        return real(key, out)

    monkeypatch.setattr(pager.swap, "read_into", hanging_read)
    set_wait_timeout(0.3)
    try:
        pager.prefetch([pb])
        with pytest.raises(PagingRecoveryError, match="B"):
            pager.close()
    finally:
        set_wait_timeout(None)
    deadline = time.monotonic() + 10
    while not (failed and torch.isnan(b).all()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert torch.isnan(b).all()  # not A's 1.0 (nor garbage)
    assert torch.all(a == 1)
