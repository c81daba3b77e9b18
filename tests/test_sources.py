"""What SRC may be: save dir, tag folder, HF checkpoint-N, HF output dir; --tag."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import zckpt
from zckpt.errors import InvalidArgumentError
from zckpt.readers import locate
from conftest import FIXTURES

HF_RUN = FIXTURES / "hf_run"


def test_save_dir_uses_latest():
    loc = locate(FIXTURES / "z3_bf16_ws2_tied" / "ckpt")
    assert (loc.kind, loc.tag, loc.model_dir) == ("save-dir", "global_step3", None)


def test_tag_folder_directly():
    loc = locate(FIXTURES / "z3_bf16_ws2_tied" / "ckpt" / "global_step3")
    assert (loc.kind, loc.tag) == ("tag-dir", "global_step3")


def test_hf_checkpoint_folder_finds_model_files():
    loc = locate(HF_RUN / "checkpoint-3")
    assert loc.kind == "hf-checkpoint" and loc.model_dir == HF_RUN / "checkpoint-3"


def test_hf_output_dir_picks_newest_complete_checkpoint():
    loc = locate(HF_RUN)
    assert loc.kind == "hf-output-dir"
    assert loc.tag_dir == HF_RUN / "checkpoint-3" / "global_step3"


def test_hf_output_dir_skips_newer_incomplete_checkpoint(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(HF_RUN, run)
    (run / "checkpoint-9").mkdir()  # a save that died before writing anything
    (run / "checkpoint-9" / "config.json").write_text("{}")
    assert locate(run).tag_dir == run / "checkpoint-3" / "global_step3"


def test_explicit_tag(tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z2_fp32_ws1_untied" / "ckpt", src)
    shutil.copytree(src / "global_step3", src / "global_step1")
    (src / "latest").write_text("global_step1")
    assert locate(src, "global_step3").tag == "global_step3"
    assert locate(src).tag == "global_step1"


def test_tag_on_a_tag_folder_is_refused():
    with pytest.raises(InvalidArgumentError, match="already a tag folder"):
        locate(FIXTURES / "z3_bf16_ws2_tied" / "ckpt" / "global_step3", "global_step9")


def test_hf_output_copies_config_and_tokenizer_with_dtype_updated(tmp_path):
    result = zckpt.consolidate(HF_RUN, tmp_path / "out", dtype="fp16")
    out = tmp_path / "out"
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(result.copied)
    assert "trainer_state.json" not in result.copied and "zero_to_fp32.py" not in result.copied
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float16"
    src_config = json.loads((HF_RUN / "checkpoint-3" / "config.json").read_text())
    assert src_config.get("dtype", src_config.get("torch_dtype")) != "float16", "source config untouched"


def test_all_source_kinds_give_the_same_weights(tmp_path):
    sources = [HF_RUN, HF_RUN / "checkpoint-3", HF_RUN / "checkpoint-3" / "global_step3"]
    states = [zckpt.load_state_dict(s, "bf16") for s in sources]
    for state in states[1:]:
        assert state.keys() == states[0].keys()
        assert all(torch.equal(state[k], states[0][k]) for k in state)


def test_tag_may_name_a_checkpoint_folder_of_an_hf_output_dir(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(HF_RUN, run)
    shutil.copytree(run / "checkpoint-3", run / "checkpoint-7")
    assert locate(run).tag_dir == run / "checkpoint-7" / "global_step3"
    loc = locate(run, "checkpoint-3")
    assert loc.tag_dir == run / "checkpoint-3" / "global_step3" and loc.model_dir == run / "checkpoint-3"
