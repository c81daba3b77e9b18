"""The CLI surface: --json, inspect, help, responsiveness (torch not imported for metadata-only commands)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import FIXTURES, cli




def test_inspect_json(capsys):
    code, out, _ = cli(capsys, "inspect", FIXTURES / "z3_bf16_ws2_frozen" / "ckpt", "--json")
    report = json.loads(out)
    assert code == 0 and report["problem"] is None
    assert (report["format"], report["zero_stage"], report["world_size"], report["train_dtype"], report["step"]) == \
        ("deepspeed", 3, 2, "bfloat16", 3)
    params = report["parameters"]
    assert params["frozen"] > 0 and params["trainable"] > 0
    assert params["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    roles = sorted(f["role"] for f in report["files"])
    assert roles == ["model_states", "model_states", "optim_states", "optim_states"]
    assert report["bytes_on_disk"] == sum(f["bytes"] for f in report["files"]) > 0


def test_inspect_text_and_incomplete_checkpoint(capsys, copy_fixture):
    code, out, _ = cli(capsys, "inspect", FIXTURES / "hf_run")
    assert code == 0 and "zero stage   3" in out and "hf-output-dir" in out
    src = copy_fixture("z2_fp32_ws3_untied")
    (src / "global_step3" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    code, out, _ = cli(capsys, "inspect", src)
    assert code == 2 and "problem:" in out and "rank(s) [2]" in out
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in out  # files present are still listed


def test_consolidate_json(capsys, tmp_path):
    code, out, err = cli(capsys, "consolidate", FIXTURES / "hf_run", tmp_path / "o", "--json")
    result = json.loads(out)
    assert code == 0 and result["files"] == ["model.safetensors"] and result["dtype"] == "bfloat16"
    assert result["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "consolidate:" not in err, "--json implies no progress bar"


def test_progress_bar_and_quiet(capsys, tmp_path):
    code, _, err = cli(capsys, "consolidate", FIXTURES / "hf_run", tmp_path / "a")
    assert code == 0 and "consolidate" in err
    code, _, err = cli(capsys, "consolidate", FIXTURES / "hf_run", tmp_path / "b", "--quiet")
    assert code == 0 and err == ""


@pytest.mark.parametrize("command", [[], ["consolidate"], ["inspect"], ["demo"]])
def test_help_has_examples(capsys, command):
    code, out, _ = cli(capsys, *command, "--help")
    assert code == 0 and "Example" in out


def test_metadata_commands_do_not_import_torch():
    code = ("import sys; from zckpt.cli.main import main\n"
            "try: main(['inspect', sys.argv[1], '--json'])\n"
            "except SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'inspect imported torch'")
    subprocess.run([sys.executable, "-c", code, str(FIXTURES / "hf_run")], check=True, capture_output=True)


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "zckpt", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "consolidate" in proc.stdout
