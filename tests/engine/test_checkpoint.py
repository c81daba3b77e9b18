"""Native checkpoints: bit-exact round trip, manifest, the torch-free plan reader, 16-bit export, failure modes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _engine_harness import build_model, ds_config, engine_train, launch
from zckpt.errors import CheckpointCorruptError, CheckpointIncompleteError
from zckpt.readers.engine_native import is_engine_checkpoint, read_engine_plan

STAGES = [0, 1, 2, 3]
SCHED = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5,
                                        "warmup_type": "linear"}}


def _cfg(stage: int) -> dict:
    return ds_config(stage, gas=2, clip=0.5, scheduler=SCHED,
                     extra_zero={"stage3_gather_16bit_weights_on_model_save": True})


def _new_engine(engine, stage: int, seed: int):
    model = build_model(seed)
    eng, _, _, sched = engine.initialize(model=model, model_parameters=model.parameters(), config=_cfg(stage))
    return eng


def roundtrip_worker(rank: int, world_size: int, out: Path) -> None:
    import engine
    from engine.checkpoint import CheckpointError

    for stage in STAGES:
        cfg, d = _cfg(stage), out / f"s{stage}"
        eng = _new_engine(engine, stage, 0)
        engine_train(eng, cfg, 2, world_size, rank)
        eng.save_checkpoint(d / "ckpt", client_state={"epoch": 1, "note": "hi"})
        saved = eng.fp32_state_dict()
        lr_saved = eng.get_lr()
        cont = engine_train(eng, cfg, 2, world_size, rank, start_step=2)
        final = eng.fp32_state_dict()
        eng.save_16bit_model(d / "hf")
        eng.save_16bit_model(d / "hf_sharded", max_shard_size=400)
        errors = {}
        try:
            eng.save_checkpoint(d / "ckpt", tag="bad", client_state={"t": torch.ones(1)})
        except CheckpointError as exc:
            errors["client_state"] = str(exc)

        eng2 = _new_engine(engine, stage, 99)  # different init: everything must come from the checkpoint
        path, client = eng2.load_checkpoint(d / "ckpt")
        loaded = eng2.fp32_state_dict()
        same_after_load = all(torch.equal(saved[k], loaded[k]) for k in saved)
        lr_loaded = eng2.get_lr()
        resumed = engine_train(eng2, cfg, 2, world_size, rank, start_step=2)
        final2 = eng2.fp32_state_dict()
        same_final = all(torch.equal(final[k], final2[k]) for k in final)
        restaged = None
        if stage != 3:  # another stage: resharded while loading, the same fp32 masters
            other = _new_engine(engine, 3 if stage else 1, 0)
            other.load_checkpoint(d / "ckpt")
            other_loaded = other.fp32_state_dict()
            restaged = all(torch.equal(saved[k], other_loaded[k]) for k in saved)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in saved.items()}, str(d / "saved.safetensors"))
            save_file({k: v.contiguous() for k, v in final.items()}, str(d / "final.safetensors"))
        (d / f"result.rank{rank}.json").write_text(json.dumps({
            "path": path, "client": client, "same_after_load": same_after_load, "same_final": same_final,
            "cont": cont, "resumed": resumed, "global_steps": eng2.global_steps, "lr": [lr_saved, lr_loaded],
            "errors": errors, "restaged": restaged}))


def ws1_load_worker(rank: int, world_size: int, out: Path, ckpt: str) -> None:
    import engine

    eng = _new_engine(engine, 1, 0)
    path, client = eng.load_checkpoint(ckpt)
    state = eng.fp32_state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "ws1.safetensors"))
    (out / "ws1.json").write_text(json.dumps({"path": path, "client": client, "steps": eng.global_steps}))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    launch(roundtrip_worker, 2, out)
    return out


def _results(run, stage):
    return [json.loads((run / f"s{stage}" / f"result.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("stage", STAGES)
def test_roundtrip_is_bit_exact(run, stage):
    for r in _results(run, stage):
        assert r["same_after_load"] and r["same_final"]
        assert r["resumed"] == r["cont"]  # identical losses, bit for bit
        assert r["client"] == {"epoch": 1, "note": "hi"}
        assert r["global_steps"] == 4
        assert r["lr"][0] == r["lr"][1]
        assert r["path"].endswith("global_step2")
        assert "JSON" in r["errors"]["client_state"]
        assert r["restaged"] is (None if stage == 3 else True)


@pytest.mark.parametrize("stage", STAGES)
def test_layout_and_manifest(run, stage):
    ckpt = run / f"s{stage}" / "ckpt"
    assert (ckpt / "latest").read_text() == "global_step2"
    tag = ckpt / "global_step2"
    assert (tag / "COMMITTED").is_file()
    assert not list(ckpt.glob(".*tmp*")) and not (ckpt / "bad").exists()
    manifest = json.loads((tag / "manifest.json").read_text())
    assert manifest["format"] == "zckpt-engine" and manifest["format_version"] == 1
    assert manifest["stage"] == stage and manifest["world_size"] == 2
    assert manifest["aliases"] == {"head.weight": "embed.weight"}
    assert [f["name"] for f in manifest["frozen"]] == ["frozen_proj.weight", "frozen_proj.bias"]
    assert manifest["client_state"] == {"epoch": 1, "note": "hi"}
    expected_files = {"rank00000-weights.safetensors", "rank00000-optim.safetensors"}
    if stage > 0:
        expected_files |= {"rank00001-weights.safetensors", "rank00001-optim.safetensors"}
    assert set(manifest["files"]) == expected_files
    import hashlib
    for fname, meta in manifest["files"].items():
        assert hashlib.sha256((tag / fname).read_bytes()).hexdigest() == meta["sha256"]
    assert manifest["scheduler"] is not None


def _assemble(plan_tensor) -> torch.Tensor:
    """Plain file reads at the plan's byte offsets + torch.frombuffer (what a writer does)."""
    dtype = getattr(torch, plan_tensor.dtype)
    out = torch.empty(plan_tensor.numel, dtype=dtype)
    size = out.element_size()
    for frag in plan_tensor.fragments:
        with open(frag.path, "rb") as f:
            f.seek(frag.offset)
            raw = bytearray(f.read(frag.numel * size))
        out[frag.dest: frag.dest + frag.numel] = torch.frombuffer(raw, dtype=dtype)
    return out.view(plan_tensor.shape)


@pytest.mark.parametrize("stage", STAGES)
def test_reader_plan_assembles_gathered_params(run, stage):
    tag = run / f"s{stage}" / "ckpt" / "global_step2"
    assert is_engine_checkpoint(tag)
    plan = read_engine_plan(tag)
    saved = load_file(str(run / f"s{stage}" / "saved.safetensors"))
    assert plan.stage == stage and plan.world_size == 2 and plan.step == 2 and plan.format == "engine"
    assert plan.aliases == {"head.weight": "embed.weight"}
    kinds = {t.name: t.kind for t in plan}
    assert kinds["frozen_proj.weight"] == "frozen" and kinds["temperature"] == "buffer"
    assert kinds["embed.weight"] == "param"
    for t in plan:
        assert torch.equal(_assemble(t), saved[t.name]), t.name
    assert set(saved) == {t.name for t in plan}


@pytest.mark.parametrize("stage", STAGES)
def test_save_16bit_model(run, stage):
    saved = load_file(str(run / f"s{stage}" / "saved.safetensors"))
    d = run / f"s{stage}"
    single = load_file(str(d / "hf" / "model.safetensors"))
    assert "head.weight" not in single  # tied: written once, as save_pretrained does
    index = json.loads((d / "hf_sharded" / "model.safetensors.index.json").read_text())
    shards = {}
    for fname in set(index["weight_map"].values()):
        shards.update(load_file(str(d / "hf_sharded" / fname)))
    assert set(shards) == set(single) == set(index["weight_map"])
    assert len(set(index["weight_map"].values())) > 1
    for k, v in single.items():
        assert torch.equal(v, shards[k])
    # fp32 training: the "16-bit" export holds the final weights exactly; the saved fp32 masters are 2 steps older
    assert set(single) == set(saved)
    final = load_file(str(d / "final.safetensors"))
    for k, v in single.items():
        assert torch.equal(v, final[k].to(v.dtype)), k


def _copy_tag(run, tmp_path, stage=2) -> Path:
    dst = tmp_path / "tag"
    shutil.copytree(run / f"s{stage}" / "ckpt" / "global_step2", dst)
    return dst


def test_reader_rejects_uncommitted(run, tmp_path):
    tag = _copy_tag(run, tmp_path)
    (tag / "COMMITTED").unlink()
    with pytest.raises(CheckpointIncompleteError, match="COMMITTED"):
        read_engine_plan(tag)


def test_reader_rejects_missing_and_truncated_files(run, tmp_path):
    tag = _copy_tag(run, tmp_path)
    (tag / "rank00001-weights.safetensors").unlink()
    with pytest.raises(CheckpointIncompleteError, match="rank00001-weights.safetensors is missing"):
        read_engine_plan(tag)
    tag2 = tmp_path / "t2"
    shutil.copytree(run / "s2" / "ckpt" / "global_step2", tag2)
    path = tag2 / "rank00000-optim.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointIncompleteError, match="truncated"):
        read_engine_plan(tag2)


def test_reader_rejects_corrupt_header(run, tmp_path):
    tag = _copy_tag(run, tmp_path)
    path = tag / "rank00000-weights.safetensors"
    data = bytearray(path.read_bytes())
    data[0:8] = (10**12).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="header length"):
        read_engine_plan(tag)


def test_reader_rejects_bad_fragment_coverage(run, tmp_path):
    tag = _copy_tag(run, tmp_path)
    manifest = json.loads((tag / "manifest.json").read_text())
    manifest["params"][0]["fragments"][0]["dest"] += 1
    (tag / "manifest.json").write_text(json.dumps(manifest))
    from engine import checkpoint_format as spec  # re-commit (COMMITTED records the manifest's sha256): the

    tag_name, _ = spec.parse_committed((tag / spec.COMMITTED).read_bytes())  # coverage check must catch it
    (tag / spec.COMMITTED).write_bytes(spec.committed_text(tag_name, (tag / "manifest.json").read_bytes()))
    with pytest.raises(CheckpointCorruptError, match="gap or overlap|cover"):
        read_engine_plan(tag)


def test_load_at_another_world_size_reshards(run, tmp_path):
    launch(ws1_load_worker, 1, tmp_path, str(run / "s1" / "ckpt"))
    result = json.loads((tmp_path / "ws1.json").read_text())
    assert result["path"].endswith("global_step2") and result["client"] == {"epoch": 1, "note": "hi"}
    assert result["steps"] == 2
    saved, loaded = load_file(str(run / "s1" / "saved.safetensors")), load_file(str(tmp_path / "ws1.safetensors"))
    assert set(saved) == set(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
