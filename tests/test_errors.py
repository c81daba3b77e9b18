"""Bad input: one-line error naming the file and the fix, exit code 2, no partial OUT, source untouched."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from zckpt.cli.main import main
from conftest import FIXTURES


def run_cli(capsys, *args) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    err = capsys.readouterr().err
    return exc.value.code, err


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_clean_failure(capsys, src: Path, out: Path, *match: str) -> str:
    before = digest(src)
    code, err = run_cli(capsys, "consolidate", src, out, "--quiet")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for m in match:
        assert m in lines[0], (m, lines[0])
    assert not out.exists(), "no partial output"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".zckpt-staging")]
    assert digest(src) == before, "source untouched"
    return lines[0]


def test_missing_rank_file(capsys, copy_fixture, tmp_path):
    src = copy_fixture("z3_bf16_ws2_tied")
    (src / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert_clean_failure(capsys, src, tmp_path / "out", "rank(s) [1]", "--tag")


def test_missing_model_states(capsys, copy_fixture, tmp_path):
    src = copy_fixture("z2_fp32_ws3_untied")
    (src / "global_step3" / "mp_rank_00_model_states.pt").unlink()
    assert_clean_failure(capsys, src, tmp_path / "out", "mp_rank_00_model_states.pt")


@pytest.mark.parametrize("keep", [0, 100, 0.5, -40])
def test_truncated_or_empty_optimizer_shard(capsys, copy_fixture, tmp_path, keep):
    src = copy_fixture("z2_bf16_ws2_tied_g2")
    victim = src / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) + keep)
    victim.write_bytes(data[:cut])
    line = assert_clean_failure(capsys, src, tmp_path / "out", victim.name)
    assert "empty" in line or "truncated" in line or "corrupt" in line


def test_latest_names_missing_tag(capsys, copy_fixture, tmp_path):
    src = copy_fixture("z1_fp32_ws1_tied")
    (src / "latest").write_text("global_step999")
    assert_clean_failure(capsys, src, tmp_path / "out", "global_step999", "--tag", "global_step3")


def test_latest_empty(capsys, copy_fixture, tmp_path):
    src = copy_fixture("z1_fp32_ws1_tied")
    (src / "latest").write_text("")
    assert_clean_failure(capsys, src, tmp_path / "out", "empty", "--tag")


def test_zero_stage0_checkpoint_is_named(capsys, tmp_path):
    """DeepSpeed without ZeRO writes only mp_rank_00_model_states.pt (weights + optimizer inside; layout as a real
    DeepSpeed 0.19.8 stage-0 save): say that, not 'saved without optimizer state'."""
    import torch

    tag = tmp_path / "ckpt" / "global_step3"
    tag.mkdir(parents=True)
    w = torch.randn(4, 3)
    torch.save({"module": {"w": w.bfloat16()}, "buffer_names": [], "param_shapes": None, "shared_params": None,
                "optimizer": {"cur_scale": 1.0, "fp32_groups": [[w]]}, "ds_config": {"zero_optimization": {"stage": 0}},
                "ds_version": "0.19.8"}, tag / "mp_rank_00_model_states.pt")
    (tmp_path / "ckpt" / "latest").write_text("global_step3")
    assert_clean_failure(capsys, tmp_path / "ckpt", tmp_path / "out", "without ZeRO", "stage 0",
                         "mp_rank_00_model_states.pt")


def test_not_a_checkpoint(capsys, tmp_path):
    src = tmp_path / "photos"
    src.mkdir()
    (src / "cat.jpg").write_bytes(b"\xff\xd8")
    assert_clean_failure(capsys, src, tmp_path / "out", "is not a checkpoint")


def test_source_does_not_exist(capsys, tmp_path):
    code, err = run_cli(capsys, "consolidate", tmp_path / "nope", tmp_path / "out")
    assert code == 2 and "does not exist" in err


def test_shards_from_another_world_size(capsys, copy_fixture, tmp_path):
    src = copy_fixture("z3_bf16_ws2_tied")
    other = copy_fixture("z3_bf16_ws3_untied_g2")
    shutil.copy(other / "global_step3" / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt", src / "global_step3")
    line = assert_clean_failure(capsys, src, tmp_path / "out", "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    assert "another" in line


def test_mixed_world_size_shard_replacing_a_rank(capsys, copy_fixture, tmp_path):
    src = copy_fixture("z3_bf16_ws2_tied")
    other = copy_fixture("z3_bf16_ws3_untied_g2")
    name = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(other / "global_step3" / name, src / "global_step3" / name)
    assert_clean_failure(capsys, src, tmp_path / "out", name, "world size 3")


def test_out_not_empty_needs_overwrite(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run_cli(capsys, "consolidate", FIXTURES / "z1_fp32_ws1_tied" / "ckpt", out, "--quiet")
    assert code == 2 and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "mine"
    code, _ = run_cli(capsys, "consolidate", FIXTURES / "z1_fp32_ws1_tied" / "ckpt", out, "--quiet", "--overwrite")
    assert code in (0, None)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "zckpt.json"]


def test_out_inside_source_is_refused(capsys, copy_fixture):
    src = copy_fixture("z1_fp32_ws1_tied")
    assert_clean_failure(capsys, src, src / "hf", "overlaps the source")


def test_bad_flags(capsys, tmp_path):
    code, err = run_cli(capsys, "consolidate", FIXTURES / "z1_fp32_ws1_tied" / "ckpt", tmp_path / "o",
                        "--dtype", "int4")
    assert code == 2 and "bf16, fp16 or fp32" in err
    code, err = run_cli(capsys, "consolidate", FIXTURES / "z1_fp32_ws1_tied" / "ckpt", tmp_path / "o",
                        "--max-shard-size", "lots")
    assert code == 2 and "--max-shard-size" in err
    assert not (tmp_path / "o").exists()


def test_failure_mid_write_leaves_nothing(monkeypatch, tmp_path):
    import zckpt
    from zckpt.writers import safetensors_stream

    calls = {"n": 0}
    real = safetensors_stream.PositionalWriter.write

    def failing(self, name, data, at=0):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(self, name, data, at)

    monkeypatch.setattr(safetensors_stream.PositionalWriter, "write", failing)
    from zckpt.errors import OutputWriteError

    with pytest.raises(OutputWriteError, match="ENOSPC"):  # the library raises only zckpt.errors types
        zckpt.consolidate(FIXTURES / "z2_fp32_ws1_untied" / "ckpt", tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_debug_shows_traceback(capsys, tmp_path):
    from zckpt.errors import SourceNotFoundError

    with pytest.raises(SourceNotFoundError):
        main(["consolidate", str(tmp_path / "nope"), str(tmp_path / "out"), "--debug"])
