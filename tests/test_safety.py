"""Reading DeepSpeed's pickles without DeepSpeed and without running code; never touching Adam moments' bytes."""

from __future__ import annotations

import os
import pickle
import sys

import pytest
import torch

import zckpt
from zckpt.errors import UnsafePickleError
from zckpt.readers.torch_pickle import TensorRef, load_lazy, load_pickle_bytes_restricted
from conftest import FIXTURES


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_without_running(copy_fixture, tmp_path, capsys):
    src = copy_fixture("z1_fp32_ws1_tied")
    marker = tmp_path / "pwned"
    victim = src / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 1, "evil": _Payload(marker)}}, victim)
    with pytest.raises(UnsafePickleError, match=r"refusing to unpickle global '(posix|os)\.system'"):
        zckpt.load_state_dict(src)
    from zckpt.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["inspect", str(src)])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and "posix.system" in captured.out + captured.err
    assert not marker.exists(), "the payload must never run"


@pytest.mark.parametrize("global_name", ["builtins.eval", "subprocess.Popen", "torch.load", "numpy.load",
                                         "deepspeed.runtime.engine.DeepSpeedEngine"])
def test_other_globals_refused(global_name):
    module, name = global_name.rsplit(".", 1)
    data = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"q\x00."
    with pytest.raises(UnsafePickleError, match=global_name.replace(".", r"\.")):
        load_pickle_bytes_restricted(data)


def test_deepspeed_names_load_as_standins_without_deepspeed():
    osd = load_lazy(FIXTURES / "z3_fp16_ws2_tied" / "ckpt" / "global_step3" /
                    "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert int(osd["zero_stage"]) == 3 and osd["partition_count"] == 2
    scaler = osd["loss_scaler"]
    assert type(scaler).__module__ == "zckpt.readers.torch_pickle"
    assert scaler.cur_scale > 0
    flat = osd["fp32_flat_groups"][0]
    assert isinstance(flat, TensorRef) and flat.dtype == "float32"


def test_reader_module_imports_neither_torch_nor_deepspeed():
    import subprocess

    code = ("import sys; from zckpt import open_plan; "
            f"p = open_plan({str(FIXTURES / 'z3_bf16_ws2_tied' / 'ckpt')!r}); "
            "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_adam_moment_bytes_are_never_read(monkeypatch):
    """Every positioned read falls inside an fp32 master partition, buffer or frozen fragment, never exp_avg."""
    tag_dir = FIXTURES / "z2_bf16_ws2_tied_g2" / "ckpt" / "global_step3"
    moments = []
    for path in tag_dir.glob("*optim_states.pt"):
        state = load_lazy(path)["optimizer_state_dict"]["base_optimizer_state"]["state"]
        for entry in state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                ref = entry[key]
                start = ref.byte_offset
                moments.append((str(path), start, start + ref.numel * 4))
    assert moments
    reads = []
    real = os.preadv

    def spy(fd, buffers, offset):
        n = real(fd, buffers, offset)
        reads.append((os.readlink(f"/proc/self/fd/{fd}"), offset, offset + n))
        return n

    monkeypatch.setattr(os, "preadv", spy)
    zckpt.load_state_dict(tag_dir.parent)
    assert reads
    for path, lo, hi in reads:
        for mpath, mlo, mhi in moments:
            assert not (os.path.samefile(path, mpath) and lo < mhi and mlo < hi), "read Adam moment bytes"
