"""`zckpt verify` (issue 10): a report of every check, exit 0 only when usable; estimates; early disk refusal."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import pytest

import zckpt
from conftest import FIXTURES, cli
from test_reliability import DS, _fp32_entry, engine_ckpt, engine_copy, flip  # noqa: F401 - fixtures


def verify(capsys, *args):
    code, out, err = cli(capsys, "verify", *args, "--json")
    assert "Traceback" not in err
    return code, (json.loads(out) if out.strip() else None), err


def test_good_checkpoints_pass(capsys, engine_ckpt):
    for src in (FIXTURES / DS / "ckpt", engine_ckpt, FIXTURES / "z3_bf16_ws2_tied" / "ckpt"):
        code, report, err = verify(capsys, src)
        assert code == 0 and report["usable"], (src, err, report)
        (c,) = report["checkpoints"]
        assert c["problem"] is None and len(c["passed"]) == 4 and c["needs"]["consolidate_disk"] > 0
    code, out, _ = cli(capsys, "verify", engine_ckpt, "--deep")
    assert code == 0 and "sha256 match" in out and "COMMITTED" in out


def test_hf_output_dir_reports_each_checkpoint(capsys):
    code, report, _ = verify(capsys, FIXTURES / "hf_run")
    assert code == 0 and report["usable"]
    by_name = {c["source"].rsplit("/", 1)[1]: c for c in report["checkpoints"]}
    assert not by_name["checkpoint-1"]["usable"] and not by_name["checkpoint-1"]["selected"]
    assert by_name["checkpoint-3"]["usable"] and by_name["checkpoint-3"]["selected"]


def test_flipped_optimizer_bit_fails_verify(capsys, engine_copy):
    victim = engine_copy / "global_step3" / "rank00001-optim.safetensors"
    flip(victim, victim.stat().st_size - 8)
    code, report, _ = verify(capsys, engine_copy)
    assert code == 2 and not report["usable"]
    assert str(victim) in report["checkpoints"][0]["problem"] and "sha256" in report["checkpoints"][0]["problem"]


def test_model_states_copy_is_checked_only_with_deep(capsys, copy_fixture):
    """DeepSpeed's 16-bit module copy in mp_rank_00_model_states.pt is read by nothing zckpt does: --deep checks it."""
    from zckpt.readers.torch_pickle import zip_checks

    src = copy_fixture(DS)
    ms = src / "global_step3" / "mp_rank_00_model_states.pt"
    check = max(zip_checks(ms), key=lambda c: c.length)
    flip(ms, check.offset + 1)
    assert verify(capsys, src)[0] == 0
    code, report, _ = verify(capsys, src, "--deep")
    assert code == 2 and "CRC-32" in report["checkpoints"][0]["problem"]


@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "global_step3" / "COMMITTED").unlink(), "COMMITTED"),
    (lambda d: (d / "latest").write_text("global_step9"), "global_step9"),
    (lambda d: (d / "global_step3" / "rank00001-weights.safetensors").unlink(), "rank00001-weights"),
    (lambda d: (d / "global_step3" / "rank00000-optim.safetensors").write_bytes(b"\0" * 8), "rank00000-optim"),
])
def test_damaged_engine_checkpoint_fails(capsys, engine_copy, damage, words):
    damage(engine_copy)
    code, report, _ = verify(capsys, engine_copy)
    assert code == 2 and words in report["checkpoints"][0]["problem"]


def test_missing_deepspeed_rank_and_bad_crc_fail(capsys, copy_fixture):
    src = copy_fixture(DS)
    shard = src / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    entry = _fp32_entry(shard)
    with open(shard, "r+b") as f:  # one byte of the fp32 partition
        from zckpt.readers.torch_pickle import zip_checks

        check = next(c for c in zip_checks(shard) if c.what == entry.filename)
        f.seek(check.offset)
        byte = f.read(1)
        f.seek(check.offset)
        f.write(bytes([byte[0] ^ 1]))
    code, report, _ = verify(capsys, src)
    assert code == 2 and "CRC-32" in report["checkpoints"][0]["problem"]
    (src / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    code, report, _ = verify(capsys, src)
    assert code == 2 and "rank(s) [1]" in report["checkpoints"][0]["problem"]


def test_text_report_and_unrecognised_source(capsys, tmp_path):
    code, out, err = cli(capsys, "verify", tmp_path)
    assert code == 2 and "NOT usable" in out and "is not a checkpoint" in out


def test_estimates_match_the_real_outputs(engine_ckpt, tmp_path):
    from zckpt.readers import open_plan
    from zckpt.verify import consolidate_needs, reshard_needs

    plan = open_plan(FIXTURES / DS / "ckpt")
    zckpt.consolidate(FIXTURES / DS / "ckpt", tmp_path / "hf")
    written = sum(p.stat().st_size for p in (tmp_path / "hf").rglob("*") if p.is_file())
    disk, ram = consolidate_needs(plan)
    assert written <= disk <= written + 2 * 2**20 and ram < 512 * 2**20
    from zckpt.reshard import reshard

    reshard(FIXTURES / DS / "ckpt", tmp_path / "rs", world_size=2)
    written = sum(p.stat().st_size for p in (tmp_path / "rs").rglob("*") if p.is_file())
    disk, _ = reshard_needs(plan)
    assert 0.9 * written <= disk <= written + 2 * 2**20


DiskUsage = namedtuple("DiskUsage", "total used free")


@pytest.mark.parametrize("command", ["consolidate", "reshard"])
def test_refuses_early_when_the_disk_is_too_small(capsys, monkeypatch, tmp_path, command):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(10**9, 10**9 - 1000, 1000))
    args = ["--world-size", "2"] if command == "reshard" else []
    code, _, err = cli(capsys, command, FIXTURES / DS / "ckpt", tmp_path / "out", "--quiet", *args)
    assert code == 2 and "needs about" in err and "free" in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []
