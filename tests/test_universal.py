"""DeepSpeed universal checkpoints: our writer against DeepSpeed's own ``ds_to_universal`` output (committed tiny
fixtures, ``fixtures/make_universal_fixtures.py``), and universal folders read as a source. Fast, no DeepSpeed.

The real-DeepSpeed resume proofs are in ``test_universal_deepspeed.py`` (``-m deepspeed``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import zckpt
from conftest import ROOT, cli
from zckpt.errors import CheckpointIncompleteError, InvalidArgumentError
from zckpt.readers import open_plan
from zckpt.reshard import reshard
from zckpt.tensors import read_tensor
from zckpt.assemble import FileCache

FIXTURES = ROOT / "fixtures" / "deepspeed"
SOURCES = ("z2_bf16_ws2_tied_g2", "z3_bf16_ws2_tied")


def _universal_tag(name: str) -> Path:
    ckpt = FIXTURES / f"universal_{name}" / "ckpt"
    return ckpt / (ckpt / "latest_universal").read_text().strip()


def _load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
                                        [t.element_size()]) if t.dim() else t.reshape(1)


def assert_same_universal_tensors(theirs: Path, ours: Path) -> int:
    """Every per-parameter file of DeepSpeed's ``zero/`` has a bit-identical twin in ours (dtype, elements; the
    shape where DeepSpeed keeps it, its extra keys such as cat_dim). Returns the number of files compared."""
    count = 0
    for folder in sorted(p for p in (theirs / "zero").iterdir() if p.is_dir()):
        for path in sorted(folder.glob("*.pt")):
            mine = ours / "zero" / folder.name / path.name
            assert mine.is_file(), f"we wrote no {mine.relative_to(ours)}"
            a, b = _load(path), _load(mine)
            if isinstance(a, dict):
                assert {k: v for k, v in a.items() if k != "param"} == \
                       {k: v for k, v in b.items() if k != "param"}, mine
                assert a["param"].shape == b["param"].shape, mine
                a, b = a["param"], b["param"]
            elif isinstance(b, dict):  # a stage-3 conversion keeps bare flat tensors; ours the dict form
                b = b["param"]
            assert a.dtype == b.dtype and a.numel() == b.numel(), mine
            assert torch.equal(_bits(a), _bits(b)), f"{mine.relative_to(ours)} differs from DeepSpeed's"
            count += 1
    return count


@pytest.mark.parametrize("name", SOURCES)
def test_writer_is_bit_identical_to_ds_to_universal(tmp_path, name):
    src = FIXTURES / name / "ckpt"
    result = reshard(src, tmp_path / "out", world_size=3, format="universal")
    ours = tmp_path / "out" / result.tag
    assert (tmp_path / "out" / "latest_universal").read_text() == result.tag
    assert (tmp_path / "out" / "latest").read_text() == result.tag
    assert assert_same_universal_tensors(_universal_tag(name), ours) >= 60
    # the step of every parameter (DeepSpeed writes step.pt only for stage 1/2 sources; we always do)
    steps = {_load(p).item() for p in ours.glob("zero/*/step.pt")}
    assert steps == {3.0}
    optim = _load(ours / "zero" / "optimizer_state.pt")
    assert optim["optimizer_state_dict"]["state"][0]["step"].item() == 3.0
    assert [g["params"] for g in optim["param_groups"]] == [[g] for g in range(len(optim["param_groups"]))]
    states = _load(ours / "mp_rank_00_model_states.pt")
    assert states["universal_checkpoint_info"] == {"universal_checkpoint_version": 0.4}
    assert states["shared_params"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert states["global_steps"] == 3 and states["dp_world_size"] == 3
    assert _load(ours / "zero_pp_rank_0_mp_rank_00_model_states.pt").keys() == states.keys()


@pytest.mark.parametrize("name", SOURCES)
def test_universal_folder_is_a_source(tmp_path, name):
    """ds_to_universal's folder reads to the source's weights and training state, byte for byte."""
    universal, source = open_plan(_universal_tag(name)), open_plan(FIXTURES / name / "ckpt")
    assert open_plan(FIXTURES / f"universal_{name}" / "ckpt").tag == _universal_tag(name).name  # latest_universal
    assert universal.format == "deepspeed-universal" and universal.stage == source.stage
    assert universal.aliases == source.aliases and universal.step == source.step == 3
    assert universal.training.state_keys == ("exp_avg", "exp_avg_sq")
    assert [g.hparams for g in universal.training.groups] == [g.hparams for g in source.training.groups]
    assert universal.training.counters == source.training.counters
    src_by_name = {t.name: t for t in source.tensors}
    files = FileCache()
    try:
        for t in universal.trainable():
            s = src_by_name[t.name]
            assert t.shape == s.shape and t.group == s.group
            for key in (None, "exp_avg", "exp_avg_sq"):
                a = read_tensor(t if key is None else t.state_tensor(key), files)
                b = read_tensor(s if key is None else s.state_tensor(key), files)
                assert torch.equal(a, b), (t.name, key)
        for a, b in zip(universal.training.groups, source.training.groups):
            assert read_tensor(a.scalars[0], files).item() == read_tensor(b.scalars[0], files).item() == 3.0
    finally:
        files.close()
    ours, theirs = zckpt.load_state_dict(_universal_tag(name), "fp32"), zckpt.load_state_dict(FIXTURES / name / "ckpt",
                                                                                               "fp32")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_universal_round_trip_and_to_engine(tmp_path, capsys):
    """Our universal output reads back to what it was written from; universal -> universal is bit-identical, and a
    universal folder reshards to an engine checkpoint."""
    src = FIXTURES / "z3_bf16_ws2_tied" / "ckpt"
    reshard(src, tmp_path / "u1", world_size=1, format="universal")
    reshard(tmp_path / "u1", tmp_path / "u2", world_size=4, format="universal")
    assert assert_same_universal_tensors(tmp_path / "u1" / "global_step3", tmp_path / "u2" / "global_step3") >= 60
    code, out, err = cli(capsys, "reshard", _universal_tag("z3_bf16_ws2_tied"), tmp_path / "eng", "--world-size", "2",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["source_format"] == "deepspeed-universal"
    code, out, err = cli(capsys, "inspect", tmp_path / "u2", "--json")
    assert code == 0 and json.loads(out)["format"] == "deepspeed-universal", err
    a, b = zckpt.load_state_dict(tmp_path / "u1", "fp32"), zckpt.load_state_dict(tmp_path / "eng", "fp32")
    c = zckpt.load_state_dict(src, "fp32")
    assert a.keys() == b.keys() == c.keys() and all(torch.equal(a[k], c[k]) and torch.equal(b[k], c[k]) for k in a)


def test_hf_trainer_run_to_universal(tmp_path):
    """An HF Trainer output dir (ZeRO-3 bf16, no universal_checkpoint_info): the universal output carries its
    config and tokenizer files and reads back to the same weights."""
    run = FIXTURES / "hf_run"
    result = reshard(run, tmp_path / "u", world_size=2, format="universal")
    assert (tmp_path / "u" / "config.json").is_file() and (tmp_path / "u" / result.tag / "zero").is_dir()
    a, b = zckpt.load_state_dict(run, "fp32"), zckpt.load_state_dict(tmp_path / "u", "fp32")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_universal_errors(tmp_path):
    bad = tmp_path / "u"
    shutil.copytree(_universal_tag("z2_bf16_ws2_tied_g2"), bad)
    (bad / "zero" / "model.norm.weight" / "fp32.pt").unlink()
    with pytest.raises(CheckpointIncompleteError, match="model.norm.weight.*fp32.pt"):
        open_plan(bad)
    with pytest.raises(InvalidArgumentError, match="--format"):
        reshard(FIXTURES / "z2_bf16_ws2_tied_g2" / "ckpt", tmp_path / "y", world_size=2, format="nope")
    assert not (tmp_path / "y").exists()
