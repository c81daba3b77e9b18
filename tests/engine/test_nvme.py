"""NVMe offload (stage 3): parameter partitions and optimizer state (masters + moments) really live in files, the run
is bit-identical to CPU offload, checkpoints are the same bytes whatever the offload, a run resumes across offload
settings, and the files are removed at the end (destroy, normal exit) and replaced when stale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _engine_harness import build_model, ds_config, engine_train, launch

STEPS = 3


def _cfg(param: str, optim: str, nvme: Path, stage: int = 3, **zero) -> dict:
    def sub(dev):
        return {"device": dev, **({"nvme_path": str(nvme)} if dev == "nvme" else {})}
    # tiny buffers and chunks: many read-aheads and many optimizer chunks even on the toy model
    extra = {"offload_optimizer": sub(optim), "sub_group_size": 7, **zero}
    if stage == 3:
        extra["offload_param"] = {**sub(param), "buffer_count": 2, "buffer_size": 8}
    return ds_config(stage, dtype="bf16", clip=1.0, extra_zero=extra)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def nvme_worker(rank: int, world_size: int, out: Path) -> None:
    import engine

    nvme = out / f"nvme-rank{rank}"
    report = {}
    for name, param, optim, zero in (("cpu", "cpu", "cpu", {}), ("nvme", "nvme", "nvme", {}),
                                     ("param_only", "nvme", "cpu", {}), ("optim_only", "cpu", "nvme", {}),
                                     ("nvme_sync", "nvme", "nvme", {"overlap_comm": False})):
        cfg = _cfg(param, optim, nvme, **zero)
        model = build_model(0)
        eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = engine_train(eng, cfg, STEPS, world_size, rank)
        r = {"losses": losses, "files": _files(nvme), "part_numel": sum(p.numel() for p in eng.mgr.part),
             "master_numel": sum(m.numel() for m in eng.optimizer.masters)}
        if eng.mgr.files is not None:
            r["staging_bytes"] = eng.mgr.files.staging_bytes()
            r["param_bytes"] = sum(n for n in eng.table.group_partition_numel) * 2
            r["read_ahead_hits"] = eng.mgr.files.stats["read_ahead_hits"]
        eng.save_checkpoint(out / f"ckpt-{name}", tag="t")
        if name == "nvme":  # an asynchronous save snapshots from the files too
            eng.save_checkpoint(out / "ckpt-nvme_async", tag="t", async_save=True)
            eng.wait_for_checkpoint()
        torch.save(eng.fp32_state_dict(), out / f"sd-{name}-rank{rank}.pt")
        eng.destroy()
        r["files_after_destroy"] = _files(nvme)
        report[name] = r
    for optim in ("cpu", "nvme"):  # stages 1/2: moments swapped to files between steps
        cfg = _cfg("cpu", optim, nvme, stage=2)
        model = build_model(0)
        eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        report[f"s2_{optim}"] = {"losses": engine_train(eng, cfg, STEPS, world_size, rank), "files": _files(nvme)}
        torch.save(eng.fp32_state_dict(), out / f"sd-s2-{optim}-rank{rank}.pt")
        eng.destroy()
        report[f"s2_{optim}"]["files_after_destroy"] = _files(nvme)
    # resume across offload settings: nvme -> cpu and cpu -> nvme, 2 more steps each; compare with cpu -> cpu
    for src, param, optim in (("nvme", "cpu", "cpu"), ("cpu", "nvme", "nvme"), ("cpu", "cpu", "cpu")):
        cfg = _cfg(param, optim, nvme)
        model = build_model(0)
        eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        eng.load_checkpoint(out / f"ckpt-{src}", tag="t")
        losses = engine_train(eng, cfg, 2, world_size, rank, start_step=STEPS)
        torch.save(eng.fp32_state_dict(), out / f"sd-resume-{src}-{param}-rank{rank}.pt")
        report[f"resume_{src}_to_{param}"] = {"losses": losses}
        eng.destroy()
    (out / f"report{rank}.json").write_text(json.dumps(report))


def _equal_sd(a: Path, b: Path) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_nvme_offload_bit_identical_resume_and_cleanup(tmp_path):
    launch(nvme_worker, 2, tmp_path)
    for rank in range(2):
        rep = json.loads((tmp_path / f"report{rank}.json").read_text())
        cpu = rep["cpu"]
        assert cpu["files"] == [] and cpu["part_numel"] > 0 and cpu["master_numel"] > 0
        for name in ("nvme", "param_only", "optim_only", "nvme_sync"):
            r = rep[name]
            assert r["losses"] == cpu["losses"], name
            assert _equal_sd(tmp_path / f"sd-cpu-rank{rank}.pt", tmp_path / f"sd-{name}-rank{rank}.pt"), name
            assert r["files_after_destroy"] == [], name
        nv = rep["nvme"]
        root = f"zckpt-engine-rank{rank}"
        assert f"{root}/param/param.group0.bin" in nv["files"]
        assert f"{root}/optimizer/optim.group0.exp_avg_sq.bin" in nv["files"]
        assert f"{root}/optimizer/optim.group0.fp32_partition.bin" in nv["files"]
        assert nv["part_numel"] == 0 and nv["master_numel"] == 0  # nothing kept in memory but staging/chunks
        assert nv["read_ahead_hits"] > 0
        assert rep["param_only"]["master_numel"] > 0 and rep["optim_only"]["part_numel"] > 0
        s2 = rep["s2_nvme"]
        assert s2["losses"] == rep["s2_cpu"]["losses"] and s2["files_after_destroy"] == []
        assert f"{root}/optimizer/group0.exp_avg.bin" in s2["files"]
        assert _equal_sd(tmp_path / f"sd-s2-cpu-rank{rank}.pt", tmp_path / f"sd-s2-nvme-rank{rank}.pt")
        for src in ("nvme_to_cpu", "cpu_to_nvme"):
            assert rep[f"resume_{src}"]["losses"] == rep["resume_cpu_to_cpu"]["losses"], src
        ref = tmp_path / f"sd-resume-cpu-cpu-rank{rank}.pt"
        assert _equal_sd(ref, tmp_path / f"sd-resume-nvme-cpu-rank{rank}.pt")
        assert _equal_sd(ref, tmp_path / f"sd-resume-cpu-nvme-rank{rank}.pt")
    # the same checkpoint bytes whatever the offload (the manifest differs only by the config it records)
    for fname in sorted(p.name for p in (tmp_path / "ckpt-cpu" / "t").glob("*.safetensors")):
        for name in ("nvme", "param_only", "optim_only", "nvme_sync", "nvme_async"):
            assert (tmp_path / f"ckpt-{name}" / "t" / fname).read_bytes() == \
                (tmp_path / "ckpt-cpu" / "t" / fname).read_bytes(), (name, fname)


def test_param_files_bounded_staging(tmp_path):
    from engine.nvme import ParamFiles

    files = ParamFiles(str(tmp_path), 0, [50, 30], torch.bfloat16, buffer_count=2, buffer_numel=10, pin=False)
    values = torch.arange(50, dtype=torch.float32)
    files.write(0, 0, values)
    assert files.read_ahead(1, 0, 10, 10) and files.read_ahead(2, 0, 20, 10)
    assert not files.read_ahead(3, 0, 30, 10)  # pool of 2 exhausted: bounded
    out = torch.empty(10, dtype=torch.bfloat16)
    files.read_into(2, 0, 20, out)
    assert torch.equal(out.float(), values[20:30]) and files.stats["read_ahead_hits"] == 1
    files.read_into(7, 0, 40, out)  # not read ahead: read synchronously into place
    assert torch.equal(out.float(), values[40:50])
    assert files.staging_bytes() == 2 * 10 * 2
    files.close()
    assert not (tmp_path / "zckpt-engine-rank0").exists()


def test_optimizer_stream_pipeline(tmp_path):
    from engine.nvme import OptimizerFiles

    files = OptimizerFiles(str(tmp_path), 0, [23], chunk_numel=4)  # 6 chunks, last one short
    files.write(0, "fp32_partition", torch.arange(23, dtype=torch.float32))
    seen = []

    def fn(off, views):
        seen.append((off, views["fp32_partition"].numel()))
        views["fp32_partition"].mul_(2)
        views["exp_avg"].add_(off)

    files.stream(0, fn)
    assert seen == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4), (20, 3)]
    assert torch.equal(files.read(0, "fp32_partition"), torch.arange(23, dtype=torch.float32) * 2)
    assert torch.equal(files.read(0, "exp_avg"), torch.arange(23).div(4, rounding_mode="floor").float() * 4)
    assert files.host_bytes() == 3 * 3 * 4 * 4
    files.close()


_EXIT_SCRIPT = """
import sys, torch, engine
sys.path.insert(0, sys.argv[2])
from _engine_harness import build_model, ds_config, engine_train
nvme = sys.argv[1]
cfg = ds_config(3, extra_zero={"offload_param": {"device": "nvme", "nvme_path": nvme},
                               "offload_optimizer": {"device": "nvme", "nvme_path": nvme}})
model = build_model(0)
eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
engine_train(eng, cfg, 1, 1, 0)
print(sorted(p.name for p in __import__("pathlib").Path(nvme).rglob("*.bin")), flush=True)
if sys.argv[3] == "os_exit":
    from engine.comm import exit_without_finalizing
    exit_without_finalizing()
"""


@pytest.mark.parametrize("how", ["return", "os_exit"])
def test_stale_dir_replaced_and_removed_at_exit(tmp_path, how):
    stale = tmp_path / "zckpt-engine-rank0" / "param"
    stale.mkdir(parents=True)
    (stale / "param.group0.bin").write_bytes(b"junk from a killed run")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(__import__("_engine_harness").free_port())}
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path), str(Path(__file__).parent), how],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "param.group0.bin" in done.stdout and "optim.group0.fp32_partition.bin" in done.stdout
    # no destroy() called: removed at interpreter exit, or by exit_without_finalizing (which skips atexit)
    assert not (tmp_path / "zckpt-engine-rank0").exists()
