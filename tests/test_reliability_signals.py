"""Nothing left behind (issue 10): SIGTERM / SIGHUP / SIGINT / `timeout` / SIGKILL during consolidate and reshard.

Each trial runs the real CLI in a subprocess whose writes are slowed down (a sleep per write call, patched in before
``main()`` runs) so that the signal lands while the staging folder is being filled; the moment is drawn at random
within the write. After a handled signal: exit 128 + signal, one line, no OUT, no staging folder. After SIGKILL
(which nothing can handle), the staging folder stays with its marker and the next run beside it removes it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zckpt
from conftest import FIXTURES, ROOT, cli

DS = FIXTURES / "z2_bf16_ws2_tied_g2" / "ckpt"

_SLOW = """
import os, sys, time
import zckpt.writers.safetensors_stream as st, engine.checkpoint_format as en
def slow(real):
    def wrapper(self, *a, **k):
        time.sleep(float(os.environ.get('SLOW_WRITE_S', '0.05')))
        return real(self, *a, **k)
    return wrapper
st.PositionalWriter.write = slow(st.PositionalWriter.write)
en.HashingWriter.write = slow(en.HashingWriter.write)
from zckpt.cli.main import main
main(sys.argv[1:])
"""


def _start(args: list, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", _SLOW, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _staging(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(".zckpt-staging")]


def _wait_for_staging(parent: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(p.is_dir() and any(p.iterdir()) for p in _staging(parent)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no staging folder appeared"
        time.sleep(0.01)


COMMANDS = {
    "consolidate": lambda out: ["consolidate", DS, out, "--quiet"],
    "reshard": lambda out: ["reshard", DS, out, "--world-size", "3", "--quiet"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_mid_write_leaves_nothing(tmp_path, command, sig):
    out = tmp_path / "out"
    proc = _start(COMMANDS[command](out))
    _wait_for_staging(tmp_path, proc)
    time.sleep(random.uniform(0, 0.3))  # a random moment within the (slowed) write
    proc.send_signal(sig)
    stdout, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted"), err
    assert "Traceback" not in err
    assert not out.exists() and _staging(tmp_path) == []


def test_timeout_command_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), SLOW_WRITE_S="0.5")
    proc = subprocess.run(["timeout", "1.5", sys.executable, "-c", _SLOW, "consolidate", str(DS), str(out),
                           "--quiet"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 124, proc.stderr  # timeout's own code once it had to send SIGTERM
    assert "interrupted by SIGTERM" in proc.stderr
    assert not out.exists() and _staging(tmp_path) == []


def test_sigkill_leaves_a_marked_staging_folder_that_the_next_run_removes(tmp_path, capsys):
    out = tmp_path / "out"
    proc = _start(COMMANDS["consolidate"](out))
    _wait_for_staging(tmp_path, proc)
    proc.kill()
    proc.communicate(timeout=60)
    (left,) = _staging(tmp_path)
    marker = json.loads((left / ".zckpt-staging.json").read_text())
    assert marker["pid"] == proc.pid and marker["tool"] == "zckpt"
    foreign = tmp_path / ".zckpt-staging-not-ours"  # no marker: never touched
    foreign.mkdir()
    (foreign / "data").write_text("keep")
    alive = tmp_path / ".zckpt-staging-alive"  # marker of a live process: never touched
    alive.mkdir()
    (alive / ".zckpt-staging.json").write_text(json.dumps({**marker, "pid": os.getppid(), "start": None}))
    code, _, err = cli(capsys, "consolidate", DS, tmp_path / "out2", "--quiet")
    assert code == 0, err
    assert not left.exists() and foreign.exists() and alive.exists()
    assert not (tmp_path / "out2" / ".zckpt-staging.json").exists()


def test_killed_between_the_overwrite_renames_restores_the_old_out(tmp_path, capsys):
    """--overwrite moves the old OUT aside, then renames the new one in: killed in between, the old OUT is put back
    by the next run (not deleted)."""
    from zckpt.outdir import MARKER, STAGING_PREFIX

    old = tmp_path / (STAGING_PREFIX + "old-x")
    (old / "out").mkdir(parents=True)
    (old / "out" / "model.safetensors").write_text("previous model")
    dead = subprocess.Popen(["true"])
    dead.wait()
    (old / MARKER).write_text(json.dumps({"tool": "zckpt", "host": os.uname().nodename, "pid": dead.pid,
                                          "start": "0"}))
    code, _, err = cli(capsys, "consolidate", DS, tmp_path / "other", "--quiet")
    assert code == 0, err
    assert (tmp_path / "out" / "model.safetensors").read_text() == "previous model"
    assert not old.exists()


def test_out_is_the_current_folder(tmp_path, capsys, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    (here / "keep.txt").write_text("mine")
    monkeypatch.chdir(here)
    for args in ([], ["--overwrite"]):
        code, _, err = cli(capsys, "consolidate", DS, ".", "--quiet", *args)
        assert code == 2 and "current folder" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(here)) == ["keep.txt"] and _staging(tmp_path) == []


def test_out_is_a_mount_point(tmp_path, capsys, monkeypatch):
    out = tmp_path / "mnt"
    out.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(out) or real(p))
    code, _, err = cli(capsys, "consolidate", DS, out, "--quiet", "--overwrite")
    assert code == 2 and "mount point" in err and str(out / "model") in err, err
    assert list(out.iterdir()) == [] and _staging(tmp_path) == []


def test_library_interrupt_removes_staging(tmp_path, monkeypatch):
    """The Python API (no CLI): a KeyboardInterrupt mid-write propagates and leaves nothing."""
    from zckpt.writers import safetensors_stream

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors_stream.PositionalWriter, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        zckpt.consolidate(DS, tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_real_file_size_limit_mid_write_is_one_line_and_leaves_nothing(tmp_path):
    """A real EFBIG (RLIMIT_FSIZE below the output's size, as a disk filling up mid-write): one line naming OUT's
    file and errno, exit 2, no OUT, no staging."""
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "zckpt", "consolidate", str(DS), str(out), "--quiet", "--dtype",
                           "fp32"], env=env, capture_output=True, text=True, timeout=120, preexec_fn=limit)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "EFBIG" in lines[0] and f"error: {out}:" in lines[0] and "ulimit" in lines[0], lines[0]
    assert not out.exists() and _staging(tmp_path) == []
