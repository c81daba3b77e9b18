from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

try:  # shared CI machines are slow and noisy: never fail a property test on timing
    from hypothesis import settings

    settings.register_profile("zckpt", deadline=None)
    settings.load_profile("zckpt")
except ImportError:
    pass

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures" / "deepspeed"


def fixture_dirs() -> list[Path]:
    return sorted(p for p in FIXTURES.iterdir() if (p / "meta.json").is_file() and (p / "ckpt").is_dir())


def fixture_ids() -> list[str]:
    return [p.name for p in fixture_dirs()]


def meta(name: str) -> dict:
    return json.loads((FIXTURES / name / "meta.json").read_text())


@pytest.fixture
def copy_fixture(tmp_path):
    """Copy a fixture's DeepSpeed save dir into tmp so a test may damage it."""

    def _copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(FIXTURES / name / "ckpt", dst)
        return dst

    return _copy


def cli(capsys, *args) -> tuple[int, str, str]:
    """Run the ``zckpt`` CLI in-process: (exit code, stdout, stderr)."""
    from zckpt.cli.main import main

    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def skip_unless_deepspeed_fp16() -> None:
    """DeepSpeed's CPU accelerator refuses fp16 on CPUs without native fp16 support ("fp16 is not supported on your
    device"), and its zero.Init then picks bf16: tests comparing against DeepSpeed in fp16 are skipped there."""
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        pytest.skip(f"DeepSpeed says fp16 is not supported on this {get_accelerator().device_name()} device")
