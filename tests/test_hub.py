"""zckpt push / consolidate --push-to against a local Hub (tests/hub_server.py) through the real huggingface_hub client.

The client is pointed at the server the way a user points it at a private Hub: ``HF_ENDPOINT`` (and
``HF_HUB_DISABLE_XET=1`` for the LFS path). Subprocess runs are the faithful ones (huggingface_hub reads the
environment at import); in-process runs set the same environment and the constants huggingface_hub cached from it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, cli
from hub_server import LocalHub

SRC = FIXTURES / "z2_fp32_ws1_untied" / "ckpt"
CONFIG = FIXTURES / "z2_fp32_ws1_untied" / "config.json"
MODEL_FILES = {"config.json", "model.safetensors.index.json"}
# httpx2, under the client, deprecates how the client passes upload bodies: theirs, not ours
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The fixture consolidated into 3 bf16 shards + index, with its config.json: a complete model folder."""
    import zckpt

    out = tmp_path_factory.mktemp("models") / "sharded"
    zckpt.consolidate(SRC, out, max_shard_size="20KB")
    shutil.copy(CONFIG, out / "config.json")
    return out


@pytest.fixture
def model(sharded, tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(sharded, folder)
    return folder


@pytest.fixture
def hub():
    with LocalHub() as server:
        yield server


@pytest.fixture
def env(hub, monkeypatch, tmp_path) -> dict[str, str]:
    """The client's environment, in this process and for subprocesses: endpoint, no Xet, a write token, an empty
    HF_HOME (no stored login of the machine running the tests)."""
    from huggingface_hub import constants

    values = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "hf_write",
              "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    for key in ("HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf-home" / "stored_tokens"))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "hf-home" / "agents.json"), raising=False)
    return {**os.environ, **values}




def zckpt_subprocess(env: dict[str, str], *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zckpt", *map(str, args)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def model_bytes(folder: Path) -> dict[str, bytes]:
    """What a push of ``folder`` must put on the Hub besides the card: weights, index, config."""
    return {p.name: p.read_bytes() for p in folder.iterdir()
            if p.name.endswith(".safetensors") or p.name in MODEL_FILES}


def card(data: bytes):
    from huggingface_hub import ModelCard

    return ModelCard(data.decode())


def one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def remote_calls(hub: LocalHub) -> list[tuple[str, str]]:
    return [(m, p) for m, p, _ in hub.log if p != "/api/agent-harnesses"]  # the client's best-effort telemetry


# ---- the real thing: subprocesses ----------------------------------------------------------------------------

def test_consolidate_push_to_uploads_and_verifies(env, hub, tmp_path):
    out = tmp_path / "out"
    run = zckpt_subprocess(env, "consolidate", SRC, out, "--push-to", "alice/tiny", "--max-shard-size", "20KB",
                           "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    push = result["push"]
    assert push["verified"] and push["repo_id"] == "alice/tiny" and push["card"] == "generated"
    assert push["commit_url"] == f"{hub.url}/alice/tiny/commit/{push['commit_oid']}"
    facts = json.loads((out / "zckpt.json").read_text())
    assert (facts["source_format"], facts["zero_stage"], facts["world_size"], facts["step"], facts["dtype"]) == \
        ("deepspeed", 2, 1, 3, "bfloat16")
    remote = hub.files("alice/tiny")
    local = model_bytes(out)
    assert len([n for n in local if n.endswith(".safetensors")]) == 3
    assert {n: remote[n] for n in local} == local, "the bytes that arrived are the local files"
    assert set(remote) == set(local) | {".gitattributes", "README.md"}, "zckpt.json is for the card, not pushed"
    meta = card(remote["README.md"]).data.to_dict()
    assert meta["library_name"] == "transformers"
    assert {"zckpt", "deepspeed", "bfloat16", "zero-2"} <= set(meta["tags"])
    assert meta["zckpt"] == {"source_format": "deepspeed", "source_version": "0.19.8", "zero_stage": 2,
                             "world_size": 1, "train_dtype": "float32", "step": 3, "parameters": 23456,
                             "dtype": "bfloat16"}
    assert 'from_pretrained("alice/tiny")' in remote["README.md"].decode()
    sha = {f["name"]: f["sha256"] for f in push["files"]}
    import hashlib
    assert all(hashlib.sha256(remote[n]).hexdigest() == sha[n] for n in local)


def test_push_with_stored_login_and_stray_files(env, hub, model, tmp_path):
    (model / ".env").write_text("SECRET=1\n")
    (model / "optimizer.pt").write_bytes(b"\x80\x04pickle")
    (model / "notes.txt").write_text("mine")
    (model / ".cache").mkdir()
    (model / "runs").mkdir()
    (model / "leak.json").symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text("{}")
    home = Path(env["HF_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    (home / "token").write_text("hf_write")
    stored = {k: v for k, v in env.items() if k != "HF_TOKEN"}
    run = zckpt_subprocess(stored, "push", model, "alice/tiny", "--commit-message", "first model")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("pushed 6 file(s)") and "verified" in run.stdout
    for name in (".env", "optimizer.pt", "notes.txt", ".cache", "runs", "leak.json"):
        assert name in run.stdout  # listed as skipped, with why
    remote = hub.files("alice/tiny")
    assert set(remote) == set(model_bytes(model)) | {".gitattributes", "README.md"}
    assert {t for _, _, t in hub.log if t} == {"hf_write"}, "the stored login was used"
    assert hub.repos["alice/tiny"].commits[hub.repos["alice/tiny"].refs["main"]].message == "first model"


# ---- in-process: the surface ---------------------------------------------------------------------------------

def test_dry_run_touches_nothing_remote(env, hub, model, capsys):
    (model / "optimizer.pt").write_bytes(b"x")
    code, out, _ = cli(capsys, "push", model, "alice/tiny", "--dry-run")
    assert code == 0 and out.startswith("dry run: would push 6 file(s)")
    assert "model.safetensors.index.json" in out and "optimizer.pt (pickle" in out and "README.md" in out
    code, out, _ = cli(capsys, "push", model, "alice/tiny", "--dry-run", "--json")
    result = json.loads(out)
    assert result["dry_run"] and not result["verified"] and result["commit_url"] is None
    assert [f["name"] for f in result["files"]][-1] == "README.md"
    assert remote_calls(hub) == [] and hub.repos == {}


@pytest.mark.parametrize("damage, message", [
    ("config_link_outside", "outside"),
    ("shard_link_outside", "outside"),
    ("index_dotdot", "not a file beside it"),
    ("missing_shard", "is missing but"),
    ("truncated_shard", "truncated"),
    ("both_weights", "holds both"),
    ("no_weights", "not a consolidated model"),
    ("bad_config", "not valid JSON"),
])
def test_refusals_before_anything_remote(env, hub, model, tmp_path, capsys, damage, message):
    shard = sorted(model.glob("model-*.safetensors"))[0]
    index = model / "model.safetensors.index.json"
    outside = tmp_path / "outside"
    outside.write_bytes(shard.read_bytes())
    if damage == "config_link_outside":
        (model / "config.json").unlink()
        (model / "config.json").symlink_to(CONFIG)
    elif damage == "shard_link_outside":
        shard.unlink()
        shard.symlink_to(outside)
    elif damage == "index_dotdot":
        data = json.loads(index.read_text())
        data["weight_map"] = {k: f"../{v}" for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data))
    elif damage == "missing_shard":
        shard.unlink()
    elif damage == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[:-1])
    elif damage == "both_weights":
        shutil.copy(shard, model / "model.safetensors")
    elif damage == "no_weights":
        index.unlink()
    elif damage == "bad_config":
        (model / "config.json").write_text("{not json")
    code, out, err = cli(capsys, "push", model, "alice/tiny")
    assert code == 2 and message in one_error_line(err) and "pushed" not in out
    assert remote_calls(hub) == []


@pytest.mark.parametrize("args, token, message", [
    (["--token", "hf_bogus"], "hf_write", "refused the token"),
    ([], None, "not logged in"),
    ([], "hf_read", "may not write"),
])
def test_auth_failures(env, hub, model, capsys, monkeypatch, args, token, message):
    if token is None:
        monkeypatch.delenv("HF_TOKEN")
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    code, out, err = cli(capsys, "push", model, "alice/tiny", *args)
    line = one_error_line(err)
    assert code == 2 and message in line and "pushed" not in out
    assert "401" in line or "403" in line


def test_forbidden_namespace_missing_repo_and_revision(env, hub, model, capsys):
    code, _, err = cli(capsys, "push", model, "bob/tiny")
    assert code == 2 and "'bob' namespace" in one_error_line(err) and "403" in err
    code, _, err = cli(capsys, "push", model, "alice/nope", "--create-pr")
    assert code == 2 and "repository alice/nope not found" in one_error_line(err) and "404" in err
    hub.add_repo("alice/tiny")
    code, _, err = cli(capsys, "push", model, "alice/tiny", "--create-pr", "--revision", "nope")
    assert code == 2 and "revision 'nope' not found" in one_error_line(err)
    assert set(hub.repos) == {"alice/tiny"}


def test_network_failure(env, model, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    code, out, err = cli(capsys, "push", model, "alice/tiny")
    line = one_error_line(err)
    assert code == 2 and "creating the repository" in line and "check the network" in line and out == ""


def test_server_failing_mid_upload_then_retry(env, hub, model, capsys, monkeypatch):
    from huggingface_hub.utils import _http

    # the client retries a dropped upload 5 times with 1-8 s waits: keep its retries, skip its waiting
    no_wait = {k: getattr(time, k) for k in dir(time) if not k.startswith("_")} | {"sleep": lambda seconds: None}
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(**no_wait))
    hub.drop_put_after = 1
    code, out, err = cli(capsys, "push", model, "alice/tiny", "--quiet")
    line = one_error_line(err)
    assert code == 2 and "uploading" in line and "nothing was committed" in line and "pushed" not in out
    assert err.strip().splitlines() == [line], "--quiet: not even the client's retry warnings"
    assert set(hub.files("alice/tiny")) == {".gitattributes"}, "no commit"
    assert hub.puts >= 1 + 2 * 2, "the two failing shards were retried by the client"
    hub.drop_put_after, hub.puts = None, 0
    code, out, _ = cli(capsys, "push", model, "alice/tiny", "--quiet")
    assert code == 0 and out.startswith("pushed")
    assert hub.puts == 2, "the shard stored before the failure is not sent again"
    assert {n: hub.files("alice/tiny")[n] for n in model_bytes(model)} == model_bytes(model)


def test_commit_failure(env, hub, model, capsys):
    hub.commit_status = 500
    code, out, err = cli(capsys, "push", model, "alice/tiny")
    line = one_error_line(err)
    assert code == 2 and "500 while uploading and committing" in line and "pushed" not in out
    assert set(hub.files("alice/tiny")) == {".gitattributes"}


@pytest.mark.parametrize("lie", ["size", "sha256"])
def test_verification_catches_a_mismatch(env, hub, model, capsys, lie):
    shard = sorted(model.glob("model-*.safetensors"))[1].name
    hub.tree_lies = {shard: lie}
    code, out, err = cli(capsys, "push", model, "alice/tiny", "--quiet")
    line = one_error_line(err)
    assert code == 2 and "does not match the local files" in line and shard in line and "pushed" not in out


def test_existing_card_kept_stale_weights_deleted(env, hub, model, capsys):
    hub.page_size = 2  # the listing is paged; the client follows the Link headers
    hub.add_repo("alice/tiny", {"README.md": b"# my card\n", "model.safetensors": b"old weights",
                                "pytorch_model.bin": b"older", "notes.md": b"keep me"})
    code, out, _ = cli(capsys, "push", model, "alice/tiny", "--quiet")
    assert code == 0 and "README.md was kept" in out and "model.safetensors, pytorch_model.bin" in out
    remote = hub.files("alice/tiny")
    assert remote["README.md"] == b"# my card\n" and remote["notes.md"] == b"keep me"
    assert "model.safetensors" not in remote and "pytorch_model.bin" not in remote
    code, out, _ = cli(capsys, "push", model, "alice/tiny", "--quiet", "--overwrite-card")
    assert code == 0 and "README.md generated" in out
    assert card(hub.files("alice/tiny")["README.md"]).data.to_dict()["library_name"] == "transformers"
    (model / "README.md").write_text("---\nlicense: mit\n---\n# hand written\n")
    code, out, _ = cli(capsys, "push", model, "alice/tiny", "--quiet", "--overwrite-card")
    assert code == 0 and "the folder's README.md" in out
    assert hub.files("alice/tiny")["README.md"] == (model / "README.md").read_bytes()


def test_branch_and_pull_request(env, hub, model, capsys):
    code, out, _ = cli(capsys, "push", model, "alice/tiny", "--revision", "dev", "--private", "--quiet")
    assert code == 0 and "alice/tiny@dev" in out
    assert hub.repos["alice/tiny"].private
    assert set(hub.files("alice/tiny", "main")) == {".gitattributes"}
    assert set(model_bytes(model)) <= set(hub.files("alice/tiny", "dev"))
    code, out, _ = cli(capsys, "push", model, "alice/tiny", "--create-pr", "--json")
    result = json.loads(out)
    assert code == 0 and result["verified"] and result["pr_url"].endswith("/alice/tiny/discussions/1")
    assert set(model_bytes(model)) <= set(hub.files("alice/tiny", "refs/pr/1"))
    assert set(hub.files("alice/tiny", "main")) == {".gitattributes"}


def test_consolidate_push_to_checks_the_token_first(env, hub, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_bogus")
    code, out, err = cli(capsys, "consolidate", SRC, tmp_path / "out", "--push-to", "alice/tiny", "--quiet")
    assert code == 2 and "refused the token" in one_error_line(err)
    assert not (tmp_path / "out").exists(), "nothing written before the token is known to work"
    code, _, err = cli(capsys, "consolidate", SRC, tmp_path / "out", "--push-to", "not a repo", "--quiet")
    assert code == 2 and "REPO_ID" in one_error_line(err)


def test_consolidate_push_failure_keeps_out_and_says_how_to_retry(env, hub, tmp_path, capsys):
    hub.commit_status = 503
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, "consolidate", SRC, out, "--push-to", "alice/tiny", "--quiet")
    line = one_error_line(err)
    assert code == 2 and f"zckpt push {out} alice/tiny" in line and "pushed" not in stdout
    assert (out / "model.safetensors").is_file() and (out / "zckpt.json").is_file()
    hub.commit_status = None
    code, stdout, _ = cli(capsys, "push", out, "alice/tiny", "--quiet")  # the command the message gave
    assert code == 0 and stdout.startswith("pushed 2 file(s)")
    remote = hub.files("alice/tiny")
    assert remote["model.safetensors"] == (out / "model.safetensors").read_bytes()
    assert card(remote["README.md"]).data.to_dict()["zckpt"]["zero_stage"] == 2
