"""The hostile-user sweep (issue 10): many damaged copies of real checkpoints through consolidate, inspect and verify.

For every damage: each command ends with exit 0 or with exactly one ``error:`` line and exit 2 -- never a traceback,
never another exit code; no staging folder is left; the source is untouched; and whenever consolidate succeeds, its
output is bit-identical to the output of the undamaged checkpoint (a damage zckpt does not detect must be one that
does not change the weights: e.g. a flipped bit in Adam moments, which consolidate never reads). verify exits 0 only
when consolidate succeeds.

Damages: a bit flipped at random offsets of every file (header, pickle, tensor bytes), truncation at random lengths,
a file emptied, replaced by a folder, by a symlink loop, removed; ``latest`` garbled. The default suite runs a
sample (``SWEEP_SAMPLE`` per checkpoint); ``-m slow`` runs them all. The counts are printed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, cli

SEED = 10
SOURCES = ["z2_bf16_ws2_tied_g2", "z3_fp32_ws2_untied_g2", "engine"]
STATS: dict[str, int] = {}


def _engine_source(root: Path) -> Path:
    from zckpt.reshard import reshard

    out = root / "engine-src"
    if not out.exists():
        reshard(FIXTURES / "z3_bf16_ws2_tied" / "ckpt", out, world_size=2)
    return out


def damages(src: Path, rng: random.Random) -> list[tuple[str, object]]:
    tag = next(p for p in src.iterdir() if p.is_dir())
    out = []
    for path in sorted(p for p in tag.iterdir() if p.is_file()):
        size = path.stat().st_size
        rel = path.relative_to(src)
        for offset in sorted({rng.randrange(size) for _ in range(8)} | {0, 8, size - 1}):
            out.append((f"flip {rel}@{offset}", ("flip", rel, offset)))
        for cut in sorted({rng.randrange(size) for _ in range(3)} | {0}):
            out.append((f"truncate {rel} to {cut}", ("truncate", rel, cut)))
        out += [(f"folder {rel}", ("folder", rel, 0)), (f"loop {rel}", ("loop", rel, 0)),
                (f"remove {rel}", ("remove", rel, 0))]
    for text in ("", "x" * 5000, "../../etc", "global_step3\x1b[31m", "\0", "global_step999"):
        out.append((f"latest={text[:12]!r}", ("latest", Path("latest"), text)))
    return out


def apply(src: Path, damage) -> None:
    kind, rel, arg = damage
    path = src / rel
    if kind == "flip":
        data = bytearray(path.read_bytes())
        data[arg] ^= 0x40
        path.write_bytes(bytes(data))
    elif kind == "truncate":
        path.write_bytes(path.read_bytes()[:arg])
    elif kind == "folder":
        path.unlink()
        path.mkdir()
    elif kind == "loop":
        path.unlink()
        path.symlink_to(path.name)
    elif kind == "remove":
        path.unlink()
    elif kind == "latest":
        path.write_text(arg)


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def run_sweep(capsys, tmp_path: Path, name: str, sample: int | None) -> None:
    base = _engine_source(tmp_path) if name == "engine" else FIXTURES / name / "ckpt"
    code, _, err = cli(capsys, "consolidate", base, tmp_path / "reference", "--quiet")
    assert code == 0, err
    reference = tree_digest(tmp_path / "reference")
    cases = damages(base, random.Random(SEED))
    if sample is not None:
        cases = random.Random(SEED).sample(cases, min(sample, len(cases)))
    for label, damage in cases:
        work = tmp_path / "case"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        src = work / "src"
        shutil.copytree(base, src, symlinks=True)
        apply(src, damage)
        before = tree_digest(src)
        out = work / "out"
        results = {}
        for command in ("consolidate", "inspect", "verify"):
            args = (src, out, "--quiet") if command == "consolidate" else (src,)
            code, stdout, err = cli(capsys, command, *args)
            results[command] = code
            assert code in (0, 2), (label, command, code, err[-2000:])
            assert "Traceback" not in err + stdout, (label, command, err[-2000:])
            if code == 2 and command == "consolidate":
                lines = err.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("error: "), (label, err)
                assert "\x1b" not in err, (label, err)
        if results["consolidate"] == 0:
            assert tree_digest(out) == reference, f"{label}: consolidate succeeded with different output"
        assert not (results["verify"] == 0 and results["consolidate"] != 0), (label, results)
        assert tree_digest(src) == before, f"{label}: the source was modified"
        assert not [p for p in work.iterdir() if p.name.startswith(".zckpt-staging")], label
        key = "refused" if results["consolidate"] else "same output"
        STATS[f"{name}: {key}"] = STATS.get(f"{name}: {key}", 0) + 1
    print(f"\nsweep {name}: {json.dumps({k: v for k, v in STATS.items() if k.startswith(name)})}")


@pytest.mark.parametrize("name", SOURCES)
def test_sweep_sample(capsys, tmp_path, name):
    with capsys.disabled():
        pass
    run_sweep(capsys, tmp_path, name, int(os.environ.get("SWEEP_SAMPLE", 12)))


@pytest.mark.slow
@pytest.mark.parametrize("name", SOURCES)
def test_sweep_all(capsys, tmp_path, name):
    run_sweep(capsys, tmp_path, name, None)
    with capsys.disabled():
        print(f"\nsweep {name}: {json.dumps({k: v for k, v in STATS.items() if k.startswith(name)})}")
