"""Bit-exactness against DeepSpeed's own zero_to_fp32 reconstruction, stored beside every fixture."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import zckpt
from conftest import FIXTURES, fixture_ids, meta


@pytest.mark.parametrize("name", fixture_ids())
def test_fp32_state_dict_is_bit_identical_to_deepspeed(name):
    reference = load_file(str(FIXTURES / name / "reference.safetensors"))
    ours = zckpt.load_state_dict(FIXTURES / name / "ckpt")
    assert list(ours) == list(reference) or set(ours) == set(reference)
    frozen = set(meta(name)["frozen_names"])
    for key, ref in reference.items():
        if not ref.is_floating_point():  # integer buffers keep their dtype
            assert ours[key].dtype == ref.dtype and torch.equal(ours[key], ref), key
            continue
        assert ours[key].dtype == torch.float32 and ours[key].shape == ref.shape, key
        # DeepSpeed keeps frozen params at the training dtype; everything else it returns is fp32.
        assert ref.dtype == torch.float32 or key in frozen, key
        assert torch.equal(ours[key], ref.to(torch.float32)), key


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                               ("fp32", torch.float32)])
@pytest.mark.parametrize("name", ["z1_fp32_ws3_tied_g2", "z2_bf16_ws2_tied_g2", "z3_bf16_ws3_untied_g2",
                                  "z3_bf16_ws2_frozen", "z2_fp16_ws2_untied"])
def test_consolidated_file_equals_reference_cast(tmp_path, name, dtype, torch_dtype):
    reference = load_file(str(FIXTURES / name / "reference.safetensors"))
    result = zckpt.consolidate(FIXTURES / name / "ckpt", tmp_path / "out", dtype=dtype)
    aliases = meta(name)["shared_params"]
    assert result.files == ["model.safetensors"]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
        assert keys == set(reference) - set(aliases), "tied aliases are written once, like save_pretrained"
        for key in keys:
            got = f.get_tensor(key)
            assert got.dtype == torch_dtype
            assert torch.equal(got, reference[key].to(torch_dtype)), key


def test_sharded_output_has_index_and_equal_tensors(tmp_path):
    name = "z3_bf16_ws3_untied_g2"
    reference = load_file(str(FIXTURES / name / "reference.safetensors"))
    result = zckpt.consolidate(FIXTURES / name / "ckpt", tmp_path / "out", dtype="bf16", max_shard_size="8KB")
    shards = [f for f in result.files if f.endswith(".safetensors")]
    assert len(shards) > 2 and all(f.startswith("model-0") and "-of-" in f for f in shards)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(reference)
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in reference.values())
    seen = {}
    for shard in shards:
        seen.update(load_file(str(tmp_path / "out" / shard)))
        assert (tmp_path / "out" / shard).stat().st_size <= 8000 + 4096  # header + at most one oversize tensor
    assert set(seen) == set(reference)
    assert all(torch.equal(seen[k], reference[k].to(torch.bfloat16)) for k in reference)


def test_exclude_frozen_drops_only_frozen(tmp_path):
    name = "z3_bf16_ws2_frozen"
    frozen = set(meta(name)["frozen_names"])
    assert frozen
    state = zckpt.load_state_dict(FIXTURES / name / "ckpt", exclude_frozen=True)
    reference = load_file(str(FIXTURES / name / "reference.safetensors"))
    assert set(state) == set(reference) - frozen


@pytest.mark.parametrize("name", ["z2_bf16_ws2_buffers", "z3_fp32_ws3_buffers"])
def test_persistent_buffers_are_written(tmp_path, name):
    reference = load_file(str(FIXTURES / name / "reference.safetensors"))
    zckpt.consolidate(FIXTURES / name / "ckpt", tmp_path / "out", dtype="bf16")
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written["model.seen_tokens"].dtype == torch.int64
    assert torch.equal(written["model.seen_tokens"], reference["model.seen_tokens"])
    assert torch.equal(written["model.pos_scale"], reference["model.pos_scale"].to(torch.bfloat16))


def test_iter_state_dict_yields_one_tensor_at_a_time_in_model_order():
    name = "z2_fp32_ws3_untied"
    names = [n for n, _ in zckpt.iter_state_dict(FIXTURES / name / "ckpt", "bf16")]
    assert names == [k for k in meta(name)["reference_keys"]]
