"""With the installed DeepSpeed: write fresh checkpoints, then compare zckpt with DeepSpeed's own reconstruction.

Run with ``python -m pytest -m deepspeed`` (about 40 s per checkpoint on 2 cores).
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import ROOT

pytestmark = pytest.mark.deepspeed


@pytest.mark.parametrize("name", ["z1_fp16_ws2_tied", "z2_bf16_ws2_tied_g2", "z3_bf16_ws3_untied_g2",
                                  "z3_bf16_ws2_frozen", "z2_bf16_ws2_buffers"])
def test_fresh_checkpoint_matches_installed_deepspeed(tmp_path, name):
    pytest.importorskip("deepspeed")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if "fp16" in name:
        from conftest import skip_unless_deepspeed_fp16

        skip_unless_deepspeed_fp16()
    from safetensors import safe_open

    import zckpt

    sys.path.insert(0, str(ROOT / "fixtures"))
    from make_deepspeed_fixtures import make_fixture

    fixture = make_fixture(name, tmp_path)
    reference = get_fp32_state_dict_from_zero_checkpoint(str(fixture / "ckpt"))
    ours = zckpt.load_state_dict(fixture / "ckpt", "fp32")
    assert set(ours) == set(reference)
    for key, ref in reference.items():
        assert torch.equal(ours[key], ref.to(torch.float32)), key
    zckpt.consolidate(fixture / "ckpt", tmp_path / "hf", dtype="bf16")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        for key in f.keys():
            ref = reference[key]
            want = ref.to(torch.bfloat16) if ref.is_floating_point() else ref
            assert torch.equal(f.get_tensor(key), want), key
