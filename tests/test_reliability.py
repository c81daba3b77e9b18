"""Reliability (issue 10): integrity checked on every read, one error path, a typed error for every bad input.

Each test damages a copy of a committed fixture the way a disk, a copy or a hostile user would, and checks that
zckpt refuses it with one line naming the file (exit 2, no traceback, no OUT, no staging folder, source untouched)
instead of handing back wrong weights or a traceback. docs/reliability.md lists what each test proves.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

import zckpt
from zckpt.errors import (CheckpointCorruptError, OutputWriteError, SourceNotFoundError, SourceUnreadableError,
                          ZckptError)
from conftest import FIXTURES, cli
from test_errors import digest

DS = "z2_bf16_ws2_tied_g2"  # stage 2, 2 ranks, bf16, tied, 2 param groups


@pytest.fixture(scope="module")
def engine_ckpt(tmp_path_factory) -> Path:
    """An engine-native checkpoint (2 ranks, stage 2) made by `zckpt reshard` from a committed DeepSpeed fixture."""
    out = tmp_path_factory.mktemp("engine") / "ckpt"
    from zckpt.reshard import reshard

    reshard(FIXTURES / DS / "ckpt", out, world_size=2)
    return out


@pytest.fixture
def engine_copy(engine_ckpt, tmp_path) -> Path:
    dst = tmp_path / "eng"
    shutil.copytree(engine_ckpt, dst)
    return dst


def refused(capsys, tmp_path, *args, match=(), command="consolidate") -> str:
    """Run the CLI; assert one `error:` line, exit 2, no OUT and no staging left; return the line."""
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, command, *args, out, "--quiet", *(["--world-size", "2"]
                                                                       if command == "reshard" else []))
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err + stdout
    for m in match:
        assert m in lines[0], (m, lines[0])
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".zckpt-staging")]
    return lines[0]


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def manifest_edit(tag_dir: Path, edit, recommit: bool = True) -> None:
    """Edit the manifest; with ``recommit`` also rewrite COMMITTED's manifest sha256, as a crafted checkpoint would
    (so the structural checks, not the digest, must catch the edit)."""
    from engine import checkpoint_format as spec

    path = tag_dir / "manifest.json"
    obj = json.loads(path.read_text())
    obj = edit(obj) or obj
    path.write_text(json.dumps(obj))
    if recommit:
        tag, _ = spec.parse_committed((tag_dir / "COMMITTED").read_bytes())
        (tag_dir / "COMMITTED").write_bytes(spec.committed_text(tag, path.read_bytes()))


def test_manifest_edited_after_the_save_is_caught_by_committed_digest(capsys, engine_copy, tmp_path):
    manifest_edit(engine_copy / "global_step3", lambda o: o["params"][0].update(name="renamed.weight"),
                  recommit=False)
    refused(capsys, tmp_path, engine_copy, match=("manifest.json", "COMMITTED", "sha256"))


def test_engine_loader_checks_the_committed_digest_too(engine_copy):
    """The engine's load_checkpoint reads the manifest through the same spec function (one place for the check)."""
    import engine.checkpoint
    from engine import checkpoint_format as spec

    tag_dir = engine_copy / "global_step3"
    assert spec.read_manifest(tag_dir).tag == "global_step3"
    manifest_edit(tag_dir, lambda o: o["params"][0].update(name="renamed.weight"), recommit=False)
    with pytest.raises(spec.DigestError, match="recorded in COMMITTED"):
        spec.read_manifest(tag_dir)
    assert "spec.read_manifest" in Path(engine.checkpoint.__file__).read_text()


# --- 1. integrity on every read ----------------------------------------------------------------------------------


def test_engine_bit_flip_in_weights_is_caught_by_sha256(capsys, engine_copy, tmp_path):
    victim = engine_copy / "global_step3" / "rank00001-weights.safetensors"
    flip(victim, victim.stat().st_size - 100)  # inside the last tensor's bytes: the header stays valid
    before = digest(engine_copy)
    line = refused(capsys, tmp_path, engine_copy, match=(str(victim), "sha256"))
    assert "use an earlier checkpoint" in line
    assert digest(engine_copy) == before
    with pytest.raises(CheckpointCorruptError, match="sha256"):
        zckpt.load_state_dict(engine_copy)


def test_engine_bit_flip_in_optimizer_state_is_caught_by_reshard(capsys, engine_copy, tmp_path):
    victim = engine_copy / "global_step3" / "rank00000-optim.safetensors"
    flip(victim, victim.stat().st_size - 8)
    refused(capsys, tmp_path, engine_copy, command="reshard", match=(str(victim), "sha256"))
    code, _, err = cli(capsys, "consolidate", engine_copy, tmp_path / "weights", "--quiet")
    assert code == 0, err  # consolidate reads no optimizer byte: it is not affected (verify --deep reports it)


def _fp32_entry(shard: Path) -> zipfile.ZipInfo:
    """The zip entry holding the shard's fp32 master partition of group 0."""
    from zckpt.readers.torch_pickle import load_lazy

    ref = load_lazy(shard)["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    with zipfile.ZipFile(shard) as zf:
        return next(i for i in zf.infolist() if i.filename.endswith("/data/" + ref.storage.key))


def test_deepspeed_bit_flip_in_fp32_partition_is_caught_by_crc(capsys, copy_fixture, tmp_path):
    src = copy_fixture(DS)
    shard = src / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    entry = _fp32_entry(shard)
    from zckpt.readers.torch_pickle import zip_checks

    check = next(c for c in zip_checks(shard) if c.what == entry.filename)
    flip(shard, check.offset + check.length // 2)
    refused(capsys, tmp_path, src, match=(str(shard), "CRC-32", entry.filename))
    with pytest.raises(CheckpointCorruptError, match="CRC-32"):
        zckpt.load_state_dict(src)


def test_manifest_fragment_pointing_into_another_parameter(capsys, engine_copy, tmp_path):
    def edit(obj):
        a, b = obj["params"][0]["fragments"][0], obj["params"][1]["fragments"][0]
        b.update(file=a["file"], key=a["key"], offset=a["offset"], rank=a["rank"])

    manifest_edit(engine_copy / "global_step3", edit)
    refused(capsys, tmp_path, engine_copy, match=("claim the same bytes",))


@pytest.mark.parametrize("value", ["../../x", "/etc/passwd", "..", "sub/../../x"])
def test_manifest_file_outside_the_tag_folder(capsys, engine_copy, tmp_path, value):
    manifest_edit(engine_copy / "global_step3", lambda o: o["params"][0]["fragments"][0].update(file=value))
    refused(capsys, tmp_path, engine_copy, match=("manifest.json",))


@pytest.mark.parametrize("edit, words", [
    (lambda o: o.update(world_size=3, partition_world_size=3), "rank00002-weights.safetensors"),
    (lambda o: o.update(world_size=3), "manifest.json"),
    (lambda o: o.update(world_size=1), "manifest.json"),
    (lambda o: o.update(stage=0), "manifest.json"),
    (lambda o: o["groups"][0].update(partition_numel=o["groups"][0]["partition_numel"] + 8), "elements"),
    (lambda o: o["params"][0].update(shape=[-4, 2]), "manifest.json"),
    (lambda o: o["params"][0].update(dtype="float64"), "the manifest wants float64"),
    (lambda o: o["params"][0]["fragments"][0].update(offset=10**9), "the manifest wants"),
    (lambda o: o["params"][0]["fragments"][0].update(offset=1.5), "manifest.json"),
    (lambda o: o.update(tag="other"), "COMMITTED"),
    (lambda o: o.update(params={"not": "a list"}), "manifest.json"),
    (lambda o: o.update(state_keys=7), "manifest.json"),
    (lambda o: o.update(layout=[1, 2]), "manifest.json"),
    (lambda o: [o], "manifest.json"),
])
def test_edited_manifest_is_refused(capsys, engine_copy, tmp_path, edit, words):
    manifest_edit(engine_copy / "global_step3", edit)
    refused(capsys, tmp_path, engine_copy, match=(words,))
    with pytest.raises(ZckptError):
        zckpt.open_plan(engine_copy)


def test_safetensors_header_of_wrong_types(capsys, engine_copy, tmp_path):
    victim = engine_copy / "global_step3" / "rank00000-weights.safetensors"
    data = victim.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"] = [0.5, "x"]
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    victim.write_bytes(data[:8] + raw + data[8 + n:])
    refused(capsys, tmp_path, engine_copy, match=(str(victim),))


def _rewrite_pickle(shard: Path, transform) -> None:
    """Replace data.pkl in a torch.save zip by ``transform(old)``, with a valid CRC (zipfile computes it)."""
    tmp = shard.with_suffix(".tmp")
    with zipfile.ZipFile(shard) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, transform(data) if info.filename.endswith("data.pkl") else data)
    tmp.replace(shard)


@pytest.mark.parametrize("transform", [
    lambda b: b[: len(b) // 2],                                     # EOFError / truncated
    lambda b: b[:40] + bytes(40) + b[80:],                          # garbage opcodes
    lambda b: b"\x80\x02}q\x00X\x03\x00\x00\x00keyq\x01K\x01s.",    # a valid pickle of the wrong shape
    lambda b: b"\x80\x02]q\x00.",                                   # a list, not a dict
])
def test_pickle_damaged_under_a_valid_crc(capsys, copy_fixture, tmp_path, transform):
    src = copy_fixture(DS)
    shard = src / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _rewrite_pickle(shard, transform)
    refused(capsys, tmp_path, src, match=("global_step3",))
    with pytest.raises(ZckptError):
        zckpt.load_state_dict(src)
    code, _, err = cli(capsys, "inspect", src)
    assert code == 2 and "Traceback" not in err


def test_model_states_damaged_under_a_valid_crc(capsys, copy_fixture, tmp_path):
    src = copy_fixture(DS)
    _rewrite_pickle(src / "global_step3" / "mp_rank_00_model_states.pt", lambda b: b[:len(b) - 7])
    refused(capsys, tmp_path, src, match=("mp_rank_00_model_states.pt",))


# --- 2. one error path -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("err, words", [
    (errno.EACCES, "EACCES"), (errno.ENOSPC, "ENOSPC"), (errno.EROFS, "EROFS"), (errno.EISDIR, "EISDIR"),
    (errno.EIO, "EIO"),
])
def test_os_errors_writing_out_are_one_line(capsys, monkeypatch, tmp_path, err, words):
    from zckpt.writers import safetensors_stream

    def failing(self, name, data, at=0):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(safetensors_stream.PositionalWriter, "write", failing)
    line = refused(capsys, tmp_path, FIXTURES / DS / "ckpt", match=(words, "nothing was left behind"))
    assert "OUT" in line or str(tmp_path) in line


@pytest.mark.parametrize("err", [errno.EACCES, errno.EROFS])
def test_os_errors_creating_out_are_one_line(capsys, monkeypatch, tmp_path, err):
    import tempfile

    def failing(*a, **k):
        raise OSError(err, os.strerror(err), str(tmp_path))

    monkeypatch.setattr(tempfile, "mkdtemp", failing)
    refused(capsys, tmp_path, FIXTURES / DS / "ckpt", match=(errno.errorcode[err], str(tmp_path)))


def test_unreadable_source_file_is_named(capsys, monkeypatch, copy_fixture, tmp_path):
    src = copy_fixture(DS)
    victim = src / "global_step3" / "mp_rank_00_model_states.pt"
    real = open

    def guarded(path, *a, **k):
        if str(path) == str(victim):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr("builtins.open", guarded)
    refused(capsys, tmp_path, src, match=(str(victim), "EACCES", "permissions"))
    with pytest.raises(SourceUnreadableError):
        zckpt.open_plan(src)


def test_unreadable_tag_folder_is_not_called_empty(capsys, monkeypatch, copy_fixture, tmp_path):
    src = copy_fixture(DS)
    tag_dir = src / "global_step3"
    real = os.scandir

    def guarded(path="."):
        if str(path) == str(tag_dir):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", guarded)
    line = refused(capsys, tmp_path, src, match=(str(tag_dir), "EACCES"))
    assert "no checkpoint files" not in line


def test_symlink_loop_is_called_a_loop(capsys, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    line = refused(capsys, tmp_path, loop, match=("symlink loop",))
    assert "does not exist" not in line


def test_config_json_that_is_a_folder(capsys, copy_fixture, tmp_path):
    src = copy_fixture(DS)
    (src / "config.json").mkdir()
    refused(capsys, tmp_path, src, match=("config.json", "is a folder"))


@pytest.mark.parametrize("content", ["[1, 2]", "\"text\"", "{\"a\": ", "null"])
def test_config_json_malformed(capsys, copy_fixture, tmp_path, content):
    src = copy_fixture(DS)
    (src / "config.json").write_text(content)
    refused(capsys, tmp_path, src, match=("config.json",))


def test_latest_symlinked_to_a_system_file_is_not_echoed(capsys, copy_fixture, tmp_path):
    src = copy_fixture(DS)
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT\n")
    (src / "latest").unlink()
    (src / "latest").symlink_to(secret)
    line = refused(capsys, tmp_path, src, match=("latest", "symlink"))
    assert "TOP-SECRET" not in line


def test_control_characters_from_a_file_are_not_echoed(capsys, copy_fixture, tmp_path):
    src = copy_fixture(DS)
    (src / "latest").write_bytes(b"\x1b[2J\x1b]0;pwned\x07global_step3\r\n")
    code, out, err = cli(capsys, "consolidate", src, tmp_path / "out", "--quiet")
    assert code == 2 and "\x1b" not in err and "\x07" not in err and "\r" not in err, repr(err)
    assert "\\x1b" in err


def test_latest_too_long(capsys, copy_fixture, tmp_path):
    src = copy_fixture(DS)
    (src / "latest").write_text("x" * 100_000)
    line = refused(capsys, tmp_path, src, match=("latest",))
    assert len(line) < 600


def test_ctrl_c_exits_130_with_a_message(capsys, monkeypatch, tmp_path):
    import zckpt.api

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(zckpt.api, "consolidate", interrupted)
    code, _, err = cli(capsys, "consolidate", FIXTURES / DS / "ckpt", tmp_path / "out")
    assert code == 130 and err.startswith("error: interrupted") and "Traceback" not in err


def test_eof_error_from_a_command_is_not_aborted(capsys, monkeypatch, tmp_path):
    """typer turns an EOFError into a bare `Aborted!`: the one error path says what happened instead."""
    import zckpt.report

    def eof(*a, **k):
        raise EOFError("Ran out of input")

    monkeypatch.setattr(zckpt.report, "inspect", eof)
    code, _, err = cli(capsys, "inspect", FIXTURES / DS / "ckpt")
    assert code == 1 and "EOFError" in err and "Aborted" not in err and len(err.strip().splitlines()) == 1


def test_source_does_not_exist_raises_typed(tmp_path):
    with pytest.raises(SourceNotFoundError):
        zckpt.load_state_dict(tmp_path / "nope")


def test_library_raises_typed_errors_on_write_failure(monkeypatch, tmp_path):
    from zckpt.writers import safetensors_stream

    def failing(self, name, data, at=0):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors_stream.PositionalWriter, "write", failing)
    with pytest.raises(OutputWriteError):
        zckpt.consolidate(FIXTURES / DS / "ckpt", tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_names_from_a_checkpoint_are_printed_without_control_characters(capsys, engine_copy, tmp_path):
    def edit(obj):
        canonical = obj["params"][0]["name"]
        obj["aliases"] = {"evil\x1b]0;title\x07\x1b[2J.weight": canonical}

    manifest_edit(engine_copy / "global_step3", edit)
    for args in (("inspect", engine_copy), ("consolidate", engine_copy, tmp_path / "out", "--quiet"),
                 ("verify", engine_copy)):
        code, out, err = cli(capsys, *args)
        assert code == 0, err
        assert "\x1b" not in out + err and "\x07" not in out + err, (args, out)
    assert "evil" in cli(capsys, "inspect", engine_copy)[1]


def test_latest_symlinked_into_a_cache_blob_still_works(capsys, copy_fixture, tmp_path):
    """The Hugging Face cache links every file to a blob outside the folder: a `latest` that names a tag is fine."""
    src = copy_fixture(DS)
    blob = tmp_path / "blobs" / "abc123"
    blob.parent.mkdir()
    blob.write_text("global_step3")
    (src / "latest").unlink()
    (src / "latest").symlink_to(blob)
    code, _, err = cli(capsys, "consolidate", src, tmp_path / "out", "--quiet")
    assert code == 0, err
