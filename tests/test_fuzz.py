"""Fuzzing (issue 10): the manifest parser, the safetensors-header reader and the restricted unpickler.

Property: any input gives a result or a :mod:`zckpt.errors` exception -- never another exception, never a hang
(hypothesis' per-example deadline). Inputs are random bytes / JSON and mutations of real files (a committed
DeepSpeed fixture's pickles, an engine checkpoint's manifest and safetensors headers), which reach much deeper than
random bytes. Bounded in the default suite (``FUZZ_EXAMPLES`` per target, a few seconds); ``-m slow`` runs many more.
Each test prints how many inputs it tried.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import zipfile
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURES
from zckpt.errors import ZckptError

DEFAULT_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", 150))
SLOW_EXAMPLES = int(os.environ.get("FUZZ_SLOW_EXAMPLES", 5000))
DS_TAG = FIXTURES / "z2_bf16_ws2_tied_g2" / "ckpt" / "global_step3"
COUNTS: dict[str, int] = {}


def _settings(n: int):
    return settings(max_examples=n, deadline=timedelta(seconds=5), derandomize=False, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                  max_size=4),
                    max_leaves=12)


def _engine_dir() -> Path:
    """One engine checkpoint per session (reshard of the fixture), copied to a scratch tag folder per target."""
    root = Path(tempfile.mkdtemp(prefix="zckpt-fuzz-"))
    from zckpt.reshard import reshard

    reshard(DS_TAG.parent, root / "ckpt", world_size=2)
    return root / "ckpt" / "global_step3"


@pytest.fixture(scope="module")
def engine_tag():
    tag = _engine_dir()
    yield tag
    shutil.rmtree(tag.parents[1], ignore_errors=True)
    print(f"\nfuzz inputs tried: {json.dumps(COUNTS)}")


def _mutate_json(obj, data, depth=0):
    """Replace, delete or retype one node of ``obj`` (drawn by hypothesis)."""
    if isinstance(obj, dict) and obj and depth < 6:
        key = data.draw(st.sampled_from(sorted(obj)))
        action = data.draw(st.sampled_from(["recurse", "replace", "delete"]))
        out = dict(obj)
        if action == "recurse":
            out[key] = _mutate_json(obj[key], data, depth + 1)
        elif action == "replace":
            out[key] = data.draw(JSON)
        else:
            del out[key]
        return out
    if isinstance(obj, list) and obj and depth < 6:
        i = data.draw(st.integers(0, len(obj) - 1))
        out = list(obj)
        out[i] = _mutate_json(obj[i], data, depth + 1) if data.draw(st.booleans()) else data.draw(JSON)
        return out
    return data.draw(JSON)


def _expect_plan_or_zckpt_error(fn, *args):
    try:
        return fn(*args)
    except ZckptError:
        return None


# --- the manifest parser (engine-native reader, through the real files) -------------------------------------------


def _manifest_case(tag: Path, data) -> None:
    from zckpt.readers.engine_native import read_engine_plan

    original = json.loads((tag / "manifest.json").read_text())
    scratch = tag.parent / "scratch"
    if not scratch.exists():
        shutil.copytree(tag, scratch)
    kind = data.draw(st.sampled_from(["mutate", "mutate", "mutate", "json", "bytes"]))
    if kind == "mutate":
        raw = json.dumps(_mutate_json(original, data)).encode()
    elif kind == "json":
        raw = json.dumps(data.draw(JSON)).encode()
    else:
        raw = data.draw(st.binary(max_size=200))
    (scratch / "manifest.json").write_bytes(raw)
    COUNTS["manifest"] = COUNTS.get("manifest", 0) + 1
    _expect_plan_or_zckpt_error(read_engine_plan, scratch)


@_settings(DEFAULT_EXAMPLES)
@given(data=st.data())
def test_fuzz_manifest(engine_tag, data):
    _manifest_case(engine_tag, data)


@pytest.mark.slow
@_settings(SLOW_EXAMPLES)
@given(data=st.data())
def test_fuzz_manifest_long(engine_tag, data):
    _manifest_case(engine_tag, data)


# --- the safetensors header reader --------------------------------------------------------------------------------


def _header_case(tag: Path, data) -> None:
    from zckpt.readers.engine_native import _header

    path = tag / "rank00000-weights.safetensors"
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    kind = data.draw(st.sampled_from(["mutate", "mutate", "flip", "length", "bytes"]))
    if kind == "mutate":
        raw = json.dumps(_mutate_json(header, data)).encode()
        out = struct.pack("<Q", len(raw)) + raw + blob[8 + n:]
    elif kind == "flip":
        out = bytearray(blob)
        for _ in range(data.draw(st.integers(1, 4))):
            out[data.draw(st.integers(0, min(len(out), 8 + n) - 1))] ^= data.draw(st.integers(1, 255))
        out = bytes(out)
    elif kind == "length":
        out = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1))) + blob[8:]
    else:
        out = data.draw(st.binary(max_size=300))
    target = tag.parent / "fuzz.safetensors"
    target.write_bytes(out)
    COUNTS["safetensors_header"] = COUNTS.get("safetensors_header", 0) + 1
    _expect_plan_or_zckpt_error(_header, target)


@_settings(DEFAULT_EXAMPLES)
@given(data=st.data())
def test_fuzz_safetensors_header(engine_tag, data):
    _header_case(engine_tag, data)


@pytest.mark.slow
@_settings(SLOW_EXAMPLES)
@given(data=st.data())
def test_fuzz_safetensors_header_long(engine_tag, data):
    _header_case(engine_tag, data)


# --- the restricted unpickler (bytes, and whole torch.save archives) ----------------------------------------------


def _pickles() -> list[bytes]:
    out = []
    for path in sorted(DS_TAG.glob("*.pt")):
        with zipfile.ZipFile(path) as zf:
            out.append(zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl"))))
    return out


PICKLES = _pickles()


def _pickle_case(data) -> None:
    from zckpt.readers.torch_pickle import load_pickle_bytes_restricted

    base = data.draw(st.sampled_from(PICKLES))
    kind = data.draw(st.sampled_from(["flip", "flip", "splice", "truncate", "bytes"]))
    if kind == "flip":
        out = bytearray(base)
        for _ in range(data.draw(st.integers(1, 8))):
            out[data.draw(st.integers(0, len(out) - 1))] = data.draw(st.integers(0, 255))
        raw = bytes(out)
    elif kind == "splice":
        i = data.draw(st.integers(0, len(base)))
        raw = base[:i] + data.draw(st.binary(max_size=40)) + base[i + data.draw(st.integers(0, 40)):]
    elif kind == "truncate":
        raw = base[:data.draw(st.integers(0, len(base)))]
    else:
        raw = b"\x80\x02" + data.draw(st.binary(max_size=200))
    COUNTS["unpickler"] = COUNTS.get("unpickler", 0) + 1
    _expect_plan_or_zckpt_error(load_pickle_bytes_restricted, raw, "fuzz.pkl")


@_settings(DEFAULT_EXAMPLES * 2)
@given(data=st.data())
def test_fuzz_restricted_unpickler(data):
    _pickle_case(data)


@pytest.mark.slow
@_settings(SLOW_EXAMPLES * 2)
@given(data=st.data())
def test_fuzz_restricted_unpickler_long(data):
    _pickle_case(data)


def _archive_case(tmp: Path, data) -> None:
    """Whole DeepSpeed tag folders with one file damaged: the full reader (open_plan) and the integrity check."""
    from zckpt.integrity import regions_read, verify_regions
    from zckpt.readers import open_plan

    tag = tmp / "ckpt" / "global_step3"
    if tag.exists():
        shutil.rmtree(tmp / "ckpt")
    shutil.copytree(DS_TAG.parent, tmp / "ckpt")
    victim = data.draw(st.sampled_from(sorted(tag.glob("*.pt"))))
    blob = bytearray(victim.read_bytes())
    for _ in range(data.draw(st.integers(1, 6))):
        blob[data.draw(st.integers(0, len(blob) - 1))] ^= data.draw(st.integers(1, 255))
    victim.write_bytes(bytes(blob[:data.draw(st.integers(len(blob) // 2, len(blob)))]) if data.draw(
        st.booleans()) else bytes(blob))
    COUNTS["deepspeed_archive"] = COUNTS.get("deepspeed_archive", 0) + 1
    plan = _expect_plan_or_zckpt_error(open_plan, tmp / "ckpt")
    if plan is not None:
        _expect_plan_or_zckpt_error(verify_regions, regions_read(plan, deep=True))


@_settings(DEFAULT_EXAMPLES // 3)
@given(data=st.data())
def test_fuzz_deepspeed_archives(tmp_path, data):
    _archive_case(tmp_path, data)


@pytest.mark.slow
@_settings(SLOW_EXAMPLES // 5)
@given(data=st.data())
def test_fuzz_deepspeed_archives_long(tmp_path, data):
    _archive_case(tmp_path, data)
