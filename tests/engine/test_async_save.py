"""One-pass checkpoint writes and asynchronous saves: same bytes as a synchronous save, the state as of the call,
``latest`` moved only after the commit, failures raised on every rank at the next call."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _engine_harness import build_model, ds_config, engine_train, launch
from engine import checkpoint_io
from engine.checkpoint_format import read_manifest


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_write_safetensors_one_pass(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_io, "CHUNK_BYTES", 24)  # many chunks per tensor, boundaries mid-element
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, 5, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16),
               "step": torch.tensor(3.0), "empty": torch.zeros(0, 4), "ints": torch.arange(10, dtype=torch.int64),
               "strided": torch.randn(6, 8, generator=g).t()}
    size, sha = checkpoint_io.write_safetensors(tmp_path / "f.safetensors", tensors, {"k": "v"})
    path = tmp_path / "f.safetensors"
    assert size == path.stat().st_size and sha == _sha(path)
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k


def async_worker(rank: int, world_size: int, out: Path) -> None:
    import engine
    from engine import checkpoint as ckpt_mod
    from engine.checkpoint import CheckpointError

    report = {}
    for stage in (1, 3):
        cfg = ds_config(stage, gas=1)
        model = build_model(0)
        eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engine_train(eng, cfg, 2, world_size, rank)
        d = out / f"s{stage}"
        eng.save_checkpoint(d / "sync", tag="t2")
        eng.save_checkpoint(d / "async", tag="t2", async_save=True)  # the same state, in the background
        at_save = eng.fp32_state_dict()
        engine_train(eng, cfg, 2, world_size, rank, start_step=2)  # training goes on while it writes
        eng.save_checkpoint(d / "async", tag="t4", async_save=True)  # waits for t2's commit first
        eng.wait_for_checkpoint()
        latest_after = (d / "async" / "latest").read_text().strip()

        real_write = ckpt_mod.write_safetensors

        def failing_write(path, tensors, metadata):
            if rank == 1:
                raise OSError(28, "No space left on device")
            return real_write(path, tensors, metadata)

        ckpt_mod.write_safetensors = failing_write
        try:
            eng.save_checkpoint(d / "async", tag="t_fail", async_save=True)
            error = None
            try:
                eng.wait_for_checkpoint()
            except CheckpointError as exc:
                error = str(exc)
        finally:
            ckpt_mod.write_safetensors = real_write
        latest_after_fail = (d / "async" / "latest").read_text().strip()

        fresh_model = build_model(7)
        fresh, *_ = engine.initialize(model=fresh_model, model_parameters=fresh_model.parameters(), config=cfg)
        fresh.load_checkpoint(d / "async", tag="t2")
        loaded = fresh.fp32_state_dict()
        report[stage] = {"equal": all(torch.equal(at_save[k], loaded[k]) for k in at_save),
                         "latest_after": latest_after, "latest_after_fail": latest_after_fail, "error": error,
                         "snapshot_bytes": eng._async_saver().snapshot.nbytes}
    (out / f"rank{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("async")
    launch(async_worker, 2, out)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("stage", [1, 3])
def test_async_save_is_the_state_at_the_call_and_the_same_bytes(run, stage):
    out, reports = run
    d = out / f"s{stage}"
    sync, asyn = read_manifest(d / "sync" / "t2"), read_manifest(d / "async" / "t2")
    assert {n: (f.size, f.sha256) for n, f in sync.files.items()} == \
           {n: (f.size, f.sha256) for n, f in asyn.files.items()}
    for name, entry in asyn.files.items():
        assert _sha(d / "async" / "t2" / name) == entry.sha256
    for r in reports:
        assert r[str(stage)]["equal"] and r[str(stage)]["latest_after"] == "t4"
        assert r[str(stage)]["snapshot_bytes"] > 0


@pytest.mark.parametrize("stage", [1, 3])
def test_async_failure_raised_on_every_rank_and_latest_kept(run, stage):
    out, reports = run
    for r in reports:
        rep = r[str(stage)]
        assert rep["error"] and "No space left on device" in rep["error"] and "rank 1" in rep["error"], rep
        assert rep["latest_after_fail"] == "t4"
    names = sorted(p.name for p in (out / f"s{stage}" / "async").iterdir())
    assert names == ["latest", "t2", "t4"], names  # the failed save's temp folder is gone


def test_offloaded_step_uses_the_node_cores_shared_among_local_ranks(monkeypatch):
    from engine import optimizer as opt_mod

    monkeypatch.setattr(opt_mod.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert opt_mod.host_step_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert opt_mod.host_step_threads() == 1

    seen = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    before = torch.get_num_threads()
    master = torch.zeros(8)
    # masters on the host, communication on an accelerator: the offloaded placement (no CUDA needed to step)
    offloaded = opt_mod.ShardedOptimizer([master], [{}], {"type": "AdamW", "params": {"lr": 0.1}}, sharded=False,
                                         dp_world_size=1, comm_device=torch.device("cuda"))
    assert offloaded.step_threads == 8
    offloaded.step([torch.ones(8)])
    assert seen[0] == 8 and torch.get_num_threads() == before and master.abs().sum() > 0
    on_cpu = opt_mod.ShardedOptimizer([torch.zeros(8)], [{}], {"type": "AdamW"}, sharded=False, dp_world_size=1,
                                      comm_device=torch.device("cpu"))
    assert on_cpu.step_threads is None  # CPU training: the process's thread setting is the user's
