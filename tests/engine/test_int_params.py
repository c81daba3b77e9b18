"""Integer (frozen) parameters keep their dtype and values at every stage in bf16, also the ones stage 3 would have
partitioned in the compute dtype (300..304 in bf16 reads 300, 300, 302, 304, 304): training, GatheredParameters, the
native checkpoint (save, load, zckpt's reader), fp32_state_dict and save_16bit_model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from _engine_harness import launch

OFFSETS = list(range(300, 305))


class WithInts(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.offsets = nn.Parameter(torch.tensor(OFFSETS), requires_grad=False)

    def forward(self, x):
        return self.lin(x).float().pow(2).mean() + 0 * self.offsets.sum()


def _cfg(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}}


def worker(rank: int, world_size: int, out: Path) -> None:
    import engine

    report = {}
    for stage in (0, 1, 2, 3):
        for under_init in ((False, True) if stage == 3 else (False,)):
            name, d = f"s{stage}{'_init' if under_init else ''}", out / f"s{stage}{'_init' if under_init else ''}"
            torch.manual_seed(0)
            if under_init:
                with engine.zero.Init(config=_cfg(stage)):
                    model = WithInts()
            else:
                model = WithInts()
            eng, *_ = engine.initialize(model=model, model_parameters=[model.lin.weight, model.lin.bias],
                                        config=_cfg(stage))
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank)).to(eng.device, torch.bfloat16)
            loss = eng(x)
            eng.backward(loss)
            eng.step()
            with engine.zero.GatheredParameters([model.offsets]):
                gathered = (str(model.offsets.dtype), model.offsets.detach().cpu().tolist())
            eng.save_checkpoint(d / "ckpt")
            eng.save_16bit_model(d / "hf")
            fp32 = eng.fp32_state_dict()["offsets"]
            torch.manual_seed(1)
            model2 = WithInts()
            with torch.no_grad():
                model2.offsets.zero_()
            eng2, *_ = engine.initialize(model=model2, model_parameters=[model2.lin.weight, model2.lin.bias],
                                         config=_cfg(stage))
            eng2.load_checkpoint(d / "ckpt")
            with engine.zero.GatheredParameters([model2.offsets]):
                loaded = model2.offsets.detach().cpu().tolist()
            report[name] = {"gathered": gathered, "fp32": [str(fp32.dtype), fp32.tolist()], "loaded": loaded}
    if rank == 0:
        (out / "report.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ints")
    launch(worker, 2, out)
    return out, json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("name", ["s0", "s1", "s2", "s3", "s3_init"])
def test_integer_parameter_survives(run, name):
    out, report = run
    got = report[name]
    assert got["gathered"] == ["torch.int64", OFFSETS]
    assert got["fp32"] == ["torch.int64", OFFSETS]
    assert got["loaded"] == OFFSETS
    exported = load_file(str(out / name / "hf" / "model.safetensors"))
    assert exported["offsets"].dtype == torch.int64 and exported["offsets"].tolist() == OFFSETS

    from zckpt import load_state_dict

    state = load_state_dict(out / name / "ckpt", "bf16")
    assert state["offsets"].dtype == torch.int64 and state["offsets"].tolist() == OFFSETS
