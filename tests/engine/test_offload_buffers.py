"""The offloaded paths' reused host buffers (:mod:`engine.offload`): same values as the plain paths.

* a host :class:`GradStore` (reused, uninitialised buffers; unwritten slices zeroed at widen) gives exactly the fp32
  gradient partition of a fresh store, ``-0`` turned into ``+0`` as there, also when reused for a second window
  over stale contents and when a second piece widens it;
* :class:`Uploader` casts exactly as ``copy_`` does (chunk boundaries included);
* the fused host AdamW the offloaded optimizer uses stays within float rounding of the foreach one.
"""

from __future__ import annotations

import torch

from engine.offload import HostBuffers, Uploader
from engine.partition import Unit
from engine.zero.flat import GradStore


def _unit(index, offset, numel):
    return Unit(index=index, group=0, params=(), numel=numel, slice_numel=numel, partition_offset=offset)


def _pieces(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(5, generator=g).to(torch.bfloat16)
    a[1] = -0.0
    return a, torch.randn(4, generator=g).to(torch.bfloat16)


def _fresh(pieces, units, numel=12):
    store = GradStore(numel, torch.device("cpu"), torch.bfloat16)
    for u, p in zip(units, pieces):
        store.add(u, p)
    return store.fp32().clone()


def test_host_store_equals_fresh_store_across_windows():
    host = HostBuffers(pin=False)
    units = [_unit(0, 0, 5), _unit(1, 8, 4)]  # elements 5..7 are never written: must read as zero
    for window in range(3):
        pieces = _pieces(window)
        store = GradStore(12, torch.device("cpu"), torch.bfloat16, host=host, key=0)
        if window:  # stale contents from the last window stay in the reused buffers
            assert host.get(("low", 0), 12, torch.bfloat16).abs().sum() > 0
        for u, p in zip(units, pieces):
            store.add(u, p)
        got, want = store.fp32(), _fresh(pieces, units)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert not (torch.signbit(got) & (got == 0)).any()
        host.get(("low", 0), 12, torch.bfloat16).fill_(7.0)  # poison what a later window must not read


def test_host_store_second_piece_widens_exactly():
    host = HostBuffers(pin=False)
    host.get(("acc", 0), 6, torch.float32).fill_(3.0)  # stale accumulator
    p1, p2 = (torch.randn(6).to(torch.bfloat16) for _ in range(2))
    unit = _unit(0, 0, 6)
    store = GradStore(6, torch.device("cpu"), torch.bfloat16, host=host, key=0)
    store.add(unit, p1)
    store.add(unit, p2)
    want = torch.zeros(6).add_(p1.float()).add_(p2.float())
    assert torch.equal(store.fp32().view(torch.int32), want.view(torch.int32))
    fp32 = GradStore(6, torch.device("cpu"), torch.float32, host=host, key=1)
    host.get(("acc", 1), 6, torch.float32).fill_(5.0)
    fp32.add(unit, p1.float())
    assert torch.equal(fp32.fp32(), torch.zeros(6).add_(p1.float()))


def test_uploader_casts_like_copy(monkeypatch):
    monkeypatch.setattr(Uploader, "CHUNK", 7)  # several chunks, one partial
    up = Uploader(HostBuffers(pin=False))
    master = torch.randn(40) * 1e3
    for dtype in (torch.bfloat16, torch.float16):
        dst, want = torch.empty(30, dtype=dtype), torch.empty(30, dtype=dtype)
        up.begin()
        up.copy(dst, master[5:35], "g0", 5, master.numel())
        up.end()
        want.copy_(master[5:35])
        assert torch.equal(dst.view(torch.int16), want.view(torch.int16))


def test_fused_host_adamw_close_to_foreach():
    torch.manual_seed(0)
    start, grads = torch.randn(1000), [torch.randn(1000) for _ in range(3)]
    out = []
    for kw in ({"foreach": True}, {"fused": True}):
        p = start.clone().requires_grad_(True)
        opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, **kw)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out.append(p.detach())
    torch.testing.assert_close(out[0], out[1], rtol=1e-6, atol=1e-6)
