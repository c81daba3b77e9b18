"""Crash-consistent engine saves, proven by SIGKILL (issue 10).

A 2-rank gloo run (tests/engine/crash_train_script.py: the harness's toy model, ZeRO-2, a save after every step)
is SIGKILLed -- the whole process group: launcher and both ranks -- at a random moment after training started
(so in the middle of a step, of a rank-file write, of the commit, of ``latest``'s replacement, ...). Each time:

* ``zckpt verify`` passes on what is left (``latest`` names a committed, intact tag);
* the next launch resumes from ``latest``: it loads exactly that tag (its step), and the weights it loaded are
  bit-identical to what zckpt reads from the tag (sha256 over the fp32 state dict).

The default suite runs 3 trials (one launch costs ~3-9 s of torch start-up on a 2-core box); ``-m slow`` runs 10 with
a shell launcher and 50 with torchrun as the launcher; also one rank dying in the middle of a save while the other
finishes its part, and a disk that fills up mid-save (``RLIMIT_FSIZE``).
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zckpt
from zckpt.verify import verify

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "crash_train_script.py"
SEED = int(os.environ.get("CRASH_SEED", random.randrange(2**31)))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(save_dir: Path, out: Path, *, launcher: str, steps: int = 1000, extra: tuple = (), preexec=None,
          ) -> subprocess.Popen:
    """Start a 2-rank run in its own process group (session): ``sh`` starting both ranks with torchrun's
    environment variables, or ``torchrun`` itself."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    args = [str(SCRIPT), "--save-dir", str(save_dir), "--out", str(out), "--steps", str(steps), *extra]
    port = _free_port()
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               *args]
    else:
        quoted = " ".join(f"'{a}'" for a in args)
        rank = f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2"
        cmd = ["sh", "-c", f"RANK=0 LOCAL_RANK=0 {rank} {sys.executable} {quoted} & p0=$!; "
                           f"RANK=1 LOCAL_RANK=1 {rank} {sys.executable} {quoted} & p1=$!; "
                           "wait $p0; a=$?; wait $p1; b=$?; exit $((a | b))"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=preexec)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"run ended (code {proc.returncode}) before {path.name}: {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.02)


def _descendants(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            stack += kids
    return found


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every rank at once: the launcher's process group, and every descendant wherever it
    is (torchrun starts its workers in process groups of their own, which a group kill alone would miss)."""
    victims = _descendants(proc.pid)
    for pid in victims:  # freeze first, so that nothing runs on between the kills
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)
    proc.stderr.close()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in victims):
        assert time.monotonic() < deadline, "a rank survived SIGKILL"
        time.sleep(0.01)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0]
    except (OSError, IndexError):
        return "zombie"


def check_left(save_dir: Path) -> tuple[str, int] | None:
    """What a SIGKILL left: None when no save committed yet; else verify passes and (latest tag, step)."""
    if not (save_dir / "latest").exists():
        assert not [p for p in save_dir.glob("global_step*") if (p / "COMMITTED").exists()] if save_dir.exists() \
            else True
        return None
    report = verify(save_dir)
    assert report.usable, report.to_dict()
    checkpoint = report.checkpoints[0]
    return checkpoint.tag, checkpoint.step


def check_resumed(out: Path, save_dir: Path, expected: tuple[str, int] | None) -> None:
    resumed = out / "resumed.json"
    if expected is None:
        assert not resumed.exists()
        return
    got = json.loads(resumed.read_text())
    assert (got["tag"], got["step"]) == expected, (got, expected)
    import torch

    loaded = torch.load(out / "resumed_state.pt", weights_only=True)
    stored = zckpt.load_state_dict(save_dir / expected[0], "fp32")
    assert loaded and all(torch.equal(v, stored[k]) for k, v in loaded.items()), "resumed weights differ from the tag"


def run_trials(tmp_path: Path, trials: int, launcher: str, max_delay: float) -> list[dict]:
    rng = random.Random(SEED)
    save_dir = tmp_path / "ckpt"
    expected, log = None, []
    for trial in range(trials + 1):
        out = tmp_path / f"run{trial}"
        last = trial == trials
        partial_before = _partial_saves(save_dir)
        proc = start(save_dir, out, launcher=launcher, steps=1 if last else 1000)
        if last:  # the final launch only resumes (and trains one step) to check the last kill
            assert proc.wait(timeout=300) == 0, proc.stderr.read()
            proc.stderr.close()
            check_resumed(out, save_dir, expected)
            break
        wait_for(out / "training", proc)
        check_resumed(out, save_dir, expected)
        delay = rng.uniform(0, max_delay)
        time.sleep(delay)
        kill_group(proc)
        expected = check_left(save_dir)
        log.append({"trial": trial, "delay_s": round(delay, 3), "latest": expected,
                    "mid_save": len(_partial_saves(save_dir) - partial_before) > 0})
    mid = sum(entry["mid_save"] for entry in log)
    print(f"crash trials (seed {SEED}, {launcher}): {trials} kills, {mid} inside a save (its temporary folder "
          f"left), {len({e['latest'] for e in log})} distinct latest tags: {json.dumps(log)}")
    return log


def _partial_saves(save_dir: Path) -> set[str]:
    """The engine's temporary folders of saves that a kill interrupted (``.<tag>.tmp-*``)."""
    return {p.name for p in save_dir.glob(".*.tmp-*")} if save_dir.exists() else set()


def test_sigkill_at_random_moments(tmp_path):
    log = run_trials(tmp_path, 3, "sh", max_delay=1.5)
    assert len(log) == 3


@pytest.mark.slow
def test_sigkill_at_random_moments_10(tmp_path):
    assert len(run_trials(tmp_path, 10, "sh", max_delay=2.0)) == 10


@pytest.mark.slow
def test_sigkill_at_random_moments_50_torchrun(tmp_path):
    log = run_trials(tmp_path, 50, "torchrun", max_delay=2.0)
    assert len(log) == 50
    assert len({entry["latest"] for entry in log}) > 10, "the kills should land at many different steps"
    assert any(entry["latest"] is not None and entry["mid_save"] for entry in log), "no kill landed inside a save"


@pytest.mark.slow
def test_one_rank_dies_mid_save_while_the_other_finishes(tmp_path):
    save_dir = tmp_path / "ckpt"
    proc = start(save_dir, tmp_path / "a", launcher="sh", steps=4, extra=("--die-rank", "0", "--die-at-step", "3"))
    assert proc.wait(timeout=300) != 0
    proc.stderr.close()
    assert check_left(save_dir) == ("global_step2", 2)  # save 3 never committed: latest stays on 2
    assert not (save_dir / "global_step3").exists()
    proc = start(save_dir, tmp_path / "b", launcher="sh", steps=1)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    proc.stderr.close()
    check_resumed(tmp_path / "b", save_dir, ("global_step2", 2))


def _limit_file_size(limit: int):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


@pytest.mark.slow
def test_disk_full_mid_save_keeps_the_old_checkpoint(tmp_path):
    save_dir = tmp_path / "ckpt"
    proc = start(save_dir, tmp_path / "a", launcher="sh", steps=2)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    proc.stderr.close()
    before = check_left(save_dir)
    assert before == ("global_step2", 2)
    sizes = [p.stat().st_size for p in (save_dir / "global_step2").iterdir()]
    proc = start(save_dir, tmp_path / "b", launcher="sh", steps=2, extra=("--no-dump",),
                 preexec=_limit_file_size(max(sizes) // 2))
    assert proc.wait(timeout=300) != 0
    err = proc.stderr.read()
    proc.stderr.close()
    assert "File too large" in err or "EFBIG" in err, err[-3000:]
    assert check_left(save_dir) == before  # latest still names the old, intact checkpoint
    assert sorted(p.name for p in save_dir.iterdir() if not p.name.startswith(".")) == \
        ["global_step1", "global_step2", "latest"]
    proc = start(save_dir, tmp_path / "c", launcher="sh", steps=1)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    proc.stderr.close()
    check_resumed(tmp_path / "c", save_dir, before)
    shutil.rmtree(tmp_path / "a")
