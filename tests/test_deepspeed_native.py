"""``zckpt reshard --format deepspeed`` on the committed real-DeepSpeed fixtures (fast, default suite).

Same world size: our files equal DeepSpeed's own, object for object and bit for bit (the strongest check of the
layout math). Other world sizes: the output reads back through zckpt's DeepSpeed reader with the source's fp32
masters and optimizer state unchanged. The resume proof with real DeepSpeed is tests/test_deepspeed_native_resume.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ROOT, cli
from ds_native_compare import compare_tag_dirs, stage3_padding_masks

import zckpt
from zckpt.assemble import FileCache, read_into
from zckpt.errors import InvalidArgumentError
from zckpt.readers import open_plan
from zckpt.reshard import reshard
from zckpt.writers.deepspeed_layout import zero3_layout, zero12_layout
from zckpt.writers.deepspeed_native import DeepSpeedTarget, layout_of, optim_file_name

FIXTURES = ROOT / "fixtures" / "deepspeed"


def _world(name: str) -> int:
    return json.loads((FIXTURES / name / "meta.json").read_text())["world_size"]


@pytest.mark.parametrize("name", ["z1_bf16_ws2_untied", "z1_fp32_ws3_tied_g2", "z2_fp32_ws2_frozen",
                                  "z2_bf16_ws2_tied_g2", "z2_bf16_ws2_buffers", "z3_bf16_ws3_untied_g2",
                                  "z3_bf16_ws2_frozen", "z3_fp32_ws3_buffers"])
def test_same_world_size_equals_deepspeeds_own_files(tmp_path, name):
    src = FIXTURES / name / "ckpt"
    world = _world(name)
    result = reshard(src, tmp_path / "out", world_size=world, format="deepspeed")
    assert (tmp_path / "out" / "latest").read_text() == "global_step3"
    masks = {}
    if result.to_stage == 3:
        plan = open_plan(src)
        target = DeepSpeedTarget(world_size=world, stage=3)
        masks = stage3_padding_masks(layout_of(plan, target), lambda r: optim_file_name(plan, r))
    assert compare_tag_dirs(tmp_path / "out" / "global_step3", src / "global_step3", masks) == []


def _training_tensors(src) -> dict[str, torch.Tensor]:
    """fp32 masters and every per-parameter optimizer state tensor, through zckpt's reader."""
    plan = open_plan(src)
    files, out = FileCache(), {}
    try:
        for t in plan.trainable():
            for sub in (t, *(t.state_tensor(s.key) for s in t.state)):
                buf = torch.empty(sub.numel, dtype=getattr(torch, sub.dtype))
                read_into(sub, files, memoryview(buf.view(torch.uint8).numpy()))
                out[sub.name] = buf
    finally:
        files.close()
    steps = [s.name for g in plan.training.groups for s in g.scalars]
    return out | {"_groups": [g.hparams for g in plan.training.groups], "_steps": steps,
                  "_counters": plan.training.counters}


@pytest.mark.parametrize("name,world,stage", [("z2_bf16_ws2_tied_g2", 3, None), ("z2_fp32_ws2_frozen", 4, None),
                                              ("z3_bf16_ws3_untied_g2", 4, None), ("z3_bf16_ws2_frozen", 3, 2),
                                              ("z1_fp32_ws3_tied_g2", 2, 3), ("z2_bf16_ws2_buffers", 4, 1)])
def test_other_world_size_reads_back_unchanged(tmp_path, name, world, stage):
    src = FIXTURES / name / "ckpt"
    result = reshard(src, tmp_path / "out", world_size=world, stage=stage, format="deepspeed")
    plan = open_plan(tmp_path / "out")
    assert (plan.format, plan.world_size, plan.stage) == ("deepspeed", world, result.to_stage)
    before, after = _training_tensors(src), _training_tensors(tmp_path / "out")
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        else:
            assert value == after[key], key
    ours = zckpt.load_state_dict(tmp_path / "out", "fp32")
    theirs = zckpt.load_state_dict(src, "fp32")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_zero12_layout_follows_deepspeeds_padding_rule():
    # one group of 10 elements on 4 ranks: aligned to 2*4 -> 16, slices of 4; the padding is 0, 0, 2, 4
    layout = zero12_layout(4, [6, 4], [0, 0])
    (flat,) = layout.flat_groups
    assert flat.partition_numel == 4 and flat.padding == (0, 0, 2, 4)
    assert [[(p.param, p.start, p.count, p.dest) for p in pieces] for pieces in flat.pieces] == \
        [[(0, 0, 4, 0)], [(0, 4, 2, 0), (1, 0, 2, 2)], [(1, 2, 2, 0)], []]
    assert [flat.saved_numel(r) for r in range(4)] == [4, 4, 2, 0]


def test_zero3_layout_pieces_and_sub_groups():
    # parts ceil(n/2): 5, 2, 4; sub_group_size 5 closes a sub-group at >= 5 elements per rank, or at the group's end
    layout = zero3_layout(2, [10, 3, 7], [0, 0, 0], sub_group_size=5)
    assert [f.params for f in layout.flat_groups] == [(0,), (1, 2)]
    second = layout.flat_groups[1]
    assert second.partition_numel == 6
    assert [(p.param, p.start, p.count, p.dest) for p in second.pieces[1]] == [(1, 2, 1, 0), (2, 4, 3, 2)]


def test_deepspeed_format_refuses_stage_0(tmp_path, capsys):
    src = FIXTURES / "z2_fp32_ws2_frozen" / "ckpt"
    with pytest.raises(InvalidArgumentError, match="stage 1, 2 or 3"):
        reshard(src, tmp_path / "out", world_size=2, stage=0, format="deepspeed")
    code, _, err = cli(capsys, "reshard", str(src), str(tmp_path / "out"), "-n", "2", "--format", "deepspeed",
                       "--stage", "0")
    assert code == 2 and err.startswith("error: ") and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["z2_bf16_ws2_tied_g2", "z2_fp32_ws2_frozen", "z3_bf16_ws3_untied_g2"])
def test_engine_source_gives_deepspeeds_own_files(tmp_path, name):
    """DeepSpeed -> engine checkpoint at another N -> --format deepspeed at the original N: DeepSpeed's own files
    again (the engine plan lists frozen parameters after the trainable ones: only the module's key order differs)."""
    src = FIXTURES / name / "ckpt"
    world = _world(name)
    reshard(src, tmp_path / "engine", world_size=world + 1, format="engine")
    result = reshard(tmp_path / "engine", tmp_path / "out", world_size=world, format="deepspeed")
    assert result.source_format == "engine"
    masks = {}
    if result.to_stage == 3:
        plan = open_plan(src)
        masks = stage3_padding_masks(layout_of(plan, DeepSpeedTarget(world_size=world, stage=3)),
                                     lambda r: optim_file_name(plan, r))
    diffs = compare_tag_dirs(tmp_path / "out" / "global_step3", src / "global_step3", masks,
                             ignore=("_model_states.pt.module: key order",))
    assert diffs == []


@pytest.mark.parametrize("zip64", [False, True])
def test_streamed_files_are_valid_torch_zips(tmp_path, monkeypatch, zip64):
    """Our streamed torch.save files pass zipfile's CRC check and read back with torch's own loader (weights-only
    objects), also with zip64 size/offset fields (forced here with a tiny limit)."""
    import struct
    import zipfile

    from zckpt.writers import torch_zip
    from zckpt.writers.deepspeed_native import _scalar

    if zip64:
        monkeypatch.setattr(torch_zip, "ZIP64_LIMIT", 100)
    base = torch.arange(300, dtype=torch.float32)
    real = torch_zip.constant_storage("float32", base.numpy().tobytes())

    def fill(start, out):  # bf16 bytes of the numbers start, start + 1, ...
        n = len(out) // 2
        out[:] = torch.arange(start, start + n, dtype=torch.float32).to(torch.bfloat16).view(torch.uint8).numpy()

    lazy = torch_zip.LazyStorage("bfloat16", 1000, fill)
    obj = {"real": torch_zip.LazyTensor(real, (300,)), "view": torch_zip.LazyTensor(real, (2, 5), 10),
           "lazy": torch_zip.LazyTensor(lazy, (10, 50), 500), "scalar": _scalar("float32", 3.0),
           "empty": torch_zip.LazyTensor(torch_zip.constant_storage("bfloat16", b""), (0,))}
    size = torch_zip.save(obj, tmp_path / "x.pt", chunk_bytes=64)
    assert size == (tmp_path / "x.pt").stat().st_size
    with zipfile.ZipFile(tmp_path / "x.pt") as zf:
        assert zf.testzip() is None
        assert zf.read("x/byteorder") == b"little"
    back = torch.load(tmp_path / "x.pt", weights_only=True)
    assert torch.equal(back["real"], base) and torch.equal(back["view"], base[10:20].view(2, 5))
    assert back["view"].untyped_storage().data_ptr() == back["real"].untyped_storage().data_ptr()
    assert torch.equal(back["lazy"], torch.arange(500, 1000, dtype=torch.float32).to(torch.bfloat16).view(10, 50))
    assert back["scalar"].shape == () and back["scalar"].item() == 3.0
    assert back["empty"].dtype == torch.bfloat16 and back["empty"].shape == (0,)
    assert struct.unpack("<f", bytes(back["scalar"].untyped_storage()))[0] == 3.0
