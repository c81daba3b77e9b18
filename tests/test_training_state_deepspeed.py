"""The DeepSpeed reader's training state: optimizer moments, groups, step, loss scaler, counters, client state.

Default suite (metadata and a few byte reads, no processes): every fixture's plan carries ``exp_avg`` /
``exp_avg_sq`` for every trainable parameter, ``step == 3`` per group, the configured hyper-parameters; stage-1/2
moments agree with an independent layout (DeepSpeed's own ``param_slice_mappings``). Corrupt and elastic forms are
made by editing what the lazy unpickler returns, so no checkpoint is rewritten.

``-m deepspeed``: the real oracle. This file is also the torchrun worker (``__main__``): it loads a fixture with
DeepSpeed's ``load_checkpoint`` at its world size and dumps ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` per parameter; zckpt's assembled tensors must be bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import FIXTURES, ROOT, fixture_ids, meta

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _plan(name: str):
    from zckpt import open_plan

    return open_plan(FIXTURES / name / "ckpt")


def _read(plan):
    from zckpt.assemble import FileCache
    from zckpt.tensors import read_tensor

    files = FileCache()
    try:
        return read_tensor(plan, files)
    finally:
        files.close()


def _state(tensor, key: str) -> torch.Tensor:
    return _read(tensor.state_tensor(key))


# --- default suite -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", fixture_ids())
def test_every_trainable_param_has_adam_moments(name):
    plan = _plan(name)
    training = plan.training
    assert training is not None and training.optimizer == "adamw"
    assert training.state_keys == STATE_KEYS
    trainable = plan.trainable()
    assert trainable and {t.name for t in trainable}.isdisjoint(meta(name)["frozen_names"])
    for tensor in trainable:
        assert tuple(s.key for s in tensor.state) == STATE_KEYS, tensor.name
        assert all(s.dtype == "float32" for s in tensor.state), tensor.name
        assert tensor.group in range(len(training.groups)), tensor.name
    for tensor in plan.tensors:
        if tensor.kind != "param":
            assert tensor.state == () and tensor.group is None, tensor.name


@pytest.mark.parametrize("name", fixture_ids())
def test_groups_step_hparams_counters(name):
    info = meta(name)
    training = _plan(name).training
    decay = info["training"]["weight_decay_groups"] or [0.01]  # torch AdamW's default when the config sets none
    assert [g.index for g in training.groups] == list(range(len(decay)))
    for group, weight_decay in zip(training.groups, decay):
        assert group.hparams["lr"] == info["training"]["lr"] == 1e-3
        assert group.hparams["weight_decay"] == weight_decay
        assert group.hparams["betas"] == [0.9, 0.999] and group.hparams["eps"] == 1e-8
        assert "params" not in group.hparams
        assert [s.name for s in group.scalars] == ["step"]
        step = group.scalars[0]
        assert step.shape == () and len(step.fragments) == 1 and "rank_0_" in step.fragments[0].path
        assert _read(step).item() == 3
    assert training.counters == {"global_steps": 3, "global_samples": 6 * info["world_size"], "skipped_steps": 0}
    assert info["global_steps"] == 3
    assert training.config == info["ds_config"]
    assert training.scheduler is None and training.client_state == {}
    json.dumps([training.config, [g.hparams for g in training.groups], training.loss_scaler])


@pytest.mark.parametrize("name", fixture_ids())
def test_loss_scaler_only_for_fp16(name):
    scaler = _plan(name).training.loss_scaler
    if meta(name)["dtype"] != "fp16":
        assert scaler is None  # the engine keeps no scaler for bf16/fp32; DeepSpeed's LossScaler(1.0) is a no-op
        return
    assert scaler == {"type": "dynamic", "cur_scale": 256.0, "cur_iter": 3, "last_overflow_iter": -1,
                      "cur_hysteresis": 2, "scale_factor": 2.0, "scale_window": 1000, "min_scale": 1.0,
                      "hysteresis": 2, "consecutive_hysteresis": False, "raise_error_at_min_scale": True}


def _flat_slice(ref, start: int, numel: int) -> torch.Tensor:
    """Elements ``[start, start+numel)`` of a flat fp32 tensor in a torch.save archive, read with numpy."""
    assert ref.dtype == "float32" and ref.is_contiguous()
    return torch.from_numpy(np.fromfile(ref.path, dtype="<f4", count=numel, offset=ref.byte_offset + 4 * start))


STAGE12 = [n for n in fixture_ids() if meta(n)["stage"] in (1, 2)]
STAGE3 = [n for n in fixture_ids() if meta(n)["stage"] == 3]


@pytest.mark.parametrize("name", STAGE12)
def test_stage12_moments_match_param_slice_mappings(name):
    """DeepSpeed records, per rank and group, where each parameter's slice sits in the rank's flat partition
    (``fragment_address(numel, start)``); the slices of all ranks, in rank order, make the whole parameter."""
    from zckpt.readers.torch_pickle import load_lazy

    plan = _plan(name)
    tag_dir = FIXTURES / name / "ckpt" / meta(name)["tag"]
    prefix = "bf16_" if meta(name)["dtype"] == "bf16" else ""
    slices: dict[str, dict[str, list[torch.Tensor]]] = {}
    for rank in range(meta(name)["world_size"]):
        osd = load_lazy(tag_dir / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        base = osd["base_optimizer_state"]
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            (flat_id,) = base["param_groups"][g]["params"]
            for param, address in mapping.items():
                for key in STATE_KEYS:
                    ref = base["state"][flat_id][key]
                    slices.setdefault(param, {}).setdefault(key, []).append(
                        _flat_slice(ref, address.start, address.numel))
    trainable = plan.trainable()
    assert set(slices) == {t.name for t in trainable}
    for tensor in trainable:
        for key in STATE_KEYS:
            expected = torch.cat(slices[tensor.name][key]).reshape(tensor.shape)
            assert torch.equal(_state(tensor, key), expected), (tensor.name, key)


@pytest.mark.parametrize("name", STAGE3)
def test_stage3_moments_are_plausible(name):
    for tensor in _plan(name).trainable():
        exp_avg, exp_avg_sq = (_state(tensor, key) for key in STATE_KEYS)
        assert torch.isfinite(exp_avg).all() and torch.isfinite(exp_avg_sq).all(), tensor.name
        assert (exp_avg_sq >= 0).all(), tensor.name
        assert exp_avg_sq.count_nonzero() > 0 and exp_avg.count_nonzero() > 0, tensor.name


def test_moment_bytes_are_in_the_moment_storages_not_the_master():
    plan = _plan("z2_fp32_ws3_untied")  # rank 2 holds 4 elements of alignment padding at its moments' tail
    for tensor in plan.trainable():
        masters = {(f.path, f.offset) for f in tensor.fragments}
        for st in tensor.state:
            assert sum(f.numel for f in st.fragments) == tensor.numel
            assert masters.isdisjoint((f.path, f.offset) for f in st.fragments), tensor.name


# --- edited metadata: corrupt shards, DeepSpeed's elastic form, client state --------------------------------


def _patched_loads(monkeypatch, edit):
    """Make the DeepSpeed reader see ``edit(path, obj)`` instead of what ``load_lazy`` returned."""
    import zckpt.readers.deepspeed as ds

    real = ds.load_lazy

    def load(path):
        obj = real(path)
        edit(Path(path).name, obj)
        return obj

    monkeypatch.setattr(ds, "load_lazy", load)


def test_moment_of_wrong_size_is_corrupt_naming_the_file(monkeypatch):
    from zckpt.errors import CheckpointCorruptError

    def shorten(fname, obj):
        if fname.startswith("bf16_zero_pp_rank_1_"):
            entry = obj["optimizer_state_dict"]["base_optimizer_state"]["state"][1]
            entry["exp_avg_sq"] = replace(entry["exp_avg_sq"], shape=(entry["exp_avg_sq"].numel - 8,))

    _patched_loads(monkeypatch, shorten)
    with pytest.raises(CheckpointCorruptError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt.*"
                                                     r"'exp_avg_sq'.*has 72 elements.*80"):
        _plan("z2_bf16_ws2_tied_g2")


def test_missing_moment_on_one_rank_is_corrupt(monkeypatch):
    from zckpt.errors import CheckpointCorruptError

    def drop(fname, obj):
        if fname.startswith("zero_pp_rank_1_") and "optim" in fname:
            del obj["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]["exp_avg"]

    _patched_loads(monkeypatch, drop)
    with pytest.raises(CheckpointCorruptError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt.*'exp_avg'"):
        _plan("z3_fp32_ws2_untied_g2")


def test_elastic_form_gives_the_same_moments(monkeypatch):
    """DeepSpeed's ``elastic_checkpoint`` saves a list of per-group states, padding stripped, no param_groups."""
    name = "z2_fp32_ws3_untied"
    rigid = _plan(name)

    def to_elastic(fname, obj):
        osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
        if not (isinstance(osd, dict) and "base_optimizer_state" in osd):
            return
        base = osd["base_optimizer_state"]
        groups = []
        for g, group in enumerate(base["param_groups"]):
            entry = dict(base["state"][group["params"][0]])
            numel = osd["single_partition_of_fp32_groups"][g].numel
            for key in STATE_KEYS:
                entry[key] = replace(entry[key], shape=(numel,))
            groups.append(entry)
        osd["base_optimizer_state"] = groups

    _patched_loads(monkeypatch, to_elastic)
    elastic = _plan(name)
    assert elastic.training.state_keys == STATE_KEYS
    assert [t.state for t in elastic.trainable()] == [t.state for t in rigid.trainable()]
    (group,) = elastic.training.groups
    assert group.hparams == {"lr": 1e-3} and _read(group.scalars[0]).item() == 3  # ds_config's params only
    assert elastic.training.optimizer == "adamw"


def test_client_state_and_scheduler_are_json(monkeypatch):
    def add_client_state(fname, obj):
        if fname.endswith("model_states.pt"):
            obj.update(epoch=2, best={"loss": 1.5, "tags": ("a", "b")}, blob=object(),
                       lr_scheduler={"last_epoch": 3, "base_lrs": [1e-3], "_step_count": 4})

    _patched_loads(monkeypatch, add_client_state)
    training = _plan("z3_bf16_ws2_tied").training
    assert training.client_state == {"epoch": 2, "best": {"loss": 1.5, "tags": ["a", "b"]}}
    assert training.scheduler == {"last_epoch": 3, "base_lrs": [1e-3], "_step_count": 4}


def test_weights_path_reads_no_moment_bytes_with_state_planned():
    """consolidate must stay weights-only: the state fragments are planned, never read (see test_safety too)."""
    plan = _plan("z3_bf16_ws2_tied")
    weight_ranges = {(f.path, f.offset) for t in plan.tensors for f in t.fragments}
    state_ranges = {(f.path, f.offset) for t in plan.tensors for s in t.state for f in s.fragments}
    assert state_ranges and weight_ranges.isdisjoint(state_ranges)


# --- the real oracle: DeepSpeed's load_checkpoint + safe_get_full_* ------------------------------------------

ORACLE = ["z2_bf16_ws2_tied_g2", "z1_fp16_ws2_tied", "z2_fp32_ws2_frozen", "z2_fp32_ws3_untied",
          "z3_fp32_ws2_untied_g2", "z3_bf16_ws2_tied", "z3_bf16_ws3_untied_g2"]


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", ORACLE)
def test_moments_bit_identical_to_deepspeed_load_checkpoint(tmp_path, name):
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator
    from safetensors.torch import load_file

    if meta(name)["dtype"] == "fp16" and not get_accelerator().is_fp16_supported():
        pytest.skip("DeepSpeed refuses fp16 on this CPU (no mkldnn fp16); the fixture was made on one that has it")

    out = tmp_path / "oracle.safetensors"
    _run_oracle(name, out)
    theirs = load_file(str(out))
    plan = _plan(name)
    trainable = plan.trainable()
    assert {k.rsplit("/", 1)[0] for k in theirs} == {t.name for t in trainable}
    for tensor in trainable:
        ours = {"fp32": _read(tensor), **{key: _state(tensor, key) for key in STATE_KEYS}}
        for what, value in ours.items():
            ref = theirs[f"{tensor.name}/{what}"]
            assert ref.dtype == torch.float32 and torch.equal(value, ref.reshape(tensor.shape)), (tensor.name, what)
    info = json.loads(out.with_suffix(".json").read_text())
    assert info["global_steps"] == plan.training.counters["global_steps"]
    assert info["steps"] == [_read(g.scalars[0]).item() for g in plan.training.groups]
    assert info["loss_scaler"] == plan.training.loss_scaler


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_oracle(name: str, out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    for _attempt in range(2):  # the free port may be taken between picking it and torchrun binding it
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(meta(name)["world_size"]),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), __file__, "--name", name,
               "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if proc.returncode == 0 or "address already in use" not in (proc.stdout + proc.stderr).lower():
            break
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _oracle_worker(name: str, out: str) -> None:
    """Under torchrun: the fixture's model and config, DeepSpeed's load_checkpoint, then every trainable
    parameter's full fp32 master and moments (collective calls: every rank makes them)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "fixtures"))
    from make_deepspeed_fixtures import (CONFIGS_BY_NAME, MODEL_SEED, WEIGHT_DECAY, build_ds_config,
                                         build_model_config, frozen_prefix)
    from transformers import LlamaForCausalLM

    from engine.precision import state_from_deepspeed

    cfg = CONFIGS_BY_NAME[name]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(MODEL_SEED)
    model = LlamaForCausalLM(build_model_config(cfg))
    for pname, param in model.named_parameters():
        if cfg.frozen and pname.startswith(frozen_prefix()):
            param.requires_grad_(False)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params: list = [p for _, p in trainable]
    if cfg.groups == 2:  # HF Trainer's split, as the fixtures were trained
        decay = [p for n, p in trainable if p.ndim >= 2 and not n.endswith(".bias")]
        params = [{"params": decay, "weight_decay": WEIGHT_DECAY},
                  {"params": [p for p in params if all(p is not d for d in decay)], "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=build_ds_config(cfg))
    path, _ = engine.load_checkpoint(str(FIXTURES / name / "ckpt"), load_optimizer_states=True)
    assert path is not None, "DeepSpeed did not load the checkpoint"
    # stages 1/2 link each parameter to its moment fragments lazily, at the first step(); link them now
    getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", lambda: None)()
    dump = {}
    for pname, param in trainable:
        dump[f"{pname}/fp32"] = safe_get_full_fp32_param(param)
        for key in STATE_KEYS:
            dump[f"{pname}/{key}"] = safe_get_full_optimizer_state(param, key)
    base = engine.optimizer.optimizer  # stage 3 empties its param_groups between steps: use the flat groups
    flats = (getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
             or [group["params"][0] for group in base.param_groups])
    steps = [float(base.state[flat]["step"]) for flat in flats]
    scaler = state_from_deepspeed(engine.optimizer.loss_scaler) if cfg.dtype == "fp16" else None
    if torch.distributed.get_rank() == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in dump.items()}, out)
        Path(out).with_suffix(".json").write_text(json.dumps(
            {"global_steps": engine.global_steps, "steps": steps, "loss_scaler": scaler}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    _oracle_worker(args.name, args.out)
