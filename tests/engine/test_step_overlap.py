"""Stages 1/2: the post-step all-gathers overlap the optimizer step, and nothing changes a bit.

* In-process: :meth:`ShardedOptimizer.step` with :class:`StepBucket` s (Adam on slices, ``done()`` after each bucket)
  leaves masters and Adam state bit-identical to the whole step, for AdamW and Adam (L2), several groups, odd ranges;
  buckets that do not tile the masters fall back to the whole step without calling ``done()``.
* One spawned world of 2 gloo ranks trains the toy model at stages 1 and 2 (fp32 and bf16, gradient accumulation,
  clipping, small buckets so there are several all-gather buckets; ``overlap_comm``) with the step overlap on and off
  (``ENGINE_STEP_ALLGATHER_OVERLAP``): losses, fp32 masters and the compute parameters are bit-identical, and with
  the overlap on, each bucket after the first is stepped while the previous bucket's all-gathers are in flight;
  and a dropped stage 2/3 engine is freed, with or without ``destroy()`` (stage 2 also while the model lives on).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _engine_harness import batches, build_model, ds_config, launch, micro_batch

from engine.optimizer import ShardedOptimizer, StepBucket
from engine.zero.collectives import STEP_OVERLAP_ENV, CollectiveQueue

STEPS = 3


# -- in-process: the bucketed Adam step ---------------------------------------------------------------------------
# CUDA: the fused AdamW kernel (run with ``-m gpu`` on a GPU machine)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def _optimizer(kind: str, sizes, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    masters = [torch.randn(n, generator=g).to(device) for n in sizes]
    hparams = [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)}]
    opt = ShardedOptimizer(masters, hparams[:len(sizes)], {"type": kind, "params": {"lr": 1e-3}}, sharded=False,
                           dp_world_size=1, comm_device=torch.device(device))
    return opt


def _grads(sizes, step, device="cpu"):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(n, generator=g) * 10 ** torch.randn(n, generator=g)).to(device) for n in sizes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["AdamW", "Adam"])
def test_bucketed_step_is_bit_identical(kind, device):
    sizes = (1003, 264) if device == "cpu" else (10_000_003, 2_640_000)
    cut = sizes[0] // 2 // 8 * 8
    whole, bucketed = _optimizer(kind, sizes, device=device), _optimizer(kind, sizes, device=device)
    calls: list[int] = []
    buckets = [StepBucket(((0, 0, 8), (1, 0, 96)), lambda: calls.append(0)),
               StepBucket(((0, 8, cut),), lambda: calls.append(1)),
               StepBucket(((1, 96, sizes[1]), (0, cut, sizes[0])), lambda: calls.append(2))]
    for step in range(4):
        assert not whole.step(_grads(sizes, step, device), clip=1.0)
        assert not bucketed.step(_grads(sizes, step, device), clip=1.0, buckets=buckets)
    assert calls == [0, 1, 2] * 4
    for a, b in zip(whole.masters, bucketed.masters):
        assert torch.equal(a, b)
    sa, sb = whole.state_tensors(), bucketed.state_tensors()
    assert sa.keys() == sb.keys() and {"group0.exp_avg", "group1.step"} <= set(sa)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and sa[key].device == sb[key].device, key
        assert torch.equal(sa[key], sb[key]), key


def test_buckets_not_tiling_the_masters_fall_back_to_the_whole_step():
    sizes = (100,)
    whole, bucketed = _optimizer("AdamW", sizes), _optimizer("AdamW", sizes)
    calls = []
    gap = [StepBucket(((0, 0, 40),), lambda: calls.append(0)), StepBucket(((0, 48, 100),), lambda: calls.append(1))]
    whole.step(_grads(sizes, 0))
    bucketed.step(_grads(sizes, 0), buckets=gap)
    assert calls == [] and torch.equal(whole.masters[0], bucketed.masters[0])


def test_collective_queue_finishes_in_issue_order():
    from engine.comm import Pending

    done: list[int] = []
    q = CollectiveQueue()
    for i in range(4):
        q.push(Pending(), 10, lambda i=i: done.append(i), limit=25)
    assert done == [0, 1] and len(q) == 2 and q.numel == 20  # oldest finished while more than 25 in flight
    q.push(None, 5, lambda: done.append(4))  # synchronous: everything finishes now, in order
    assert done == [0, 1, 2, 3, 4] and len(q) == 0 and q.numel == 0


# -- two ranks: overlap on == overlap off ---------------------------------------------------------------------------
SETTINGS = {f"s{stage}_{dtype}_{mode}": (stage, dtype, mode) for stage in (1, 2) for dtype in ("fp32", "bf16")
            for mode in ("sync", "overlap")}


def _probe_buckets(eng, log: list):
    """Wrap ``step_buckets`` so each bucket's ``done()`` first records how many all-gathers are in flight."""
    original = eng.mgr.step_buckets

    def step_buckets():
        buckets = original()
        if buckets is None:
            return None
        return [StepBucket(b.ranges, (lambda b=b: (log.append(len(eng.mgr._gathers)), b.done()))) for b in buckets]
    eng.mgr.step_buckets = step_buckets


def run_settings(rank: int, world_size: int, out: Path, names: list[str]) -> None:
    import engine

    for name in names:
        stage, dtype, mode = SETTINGS[name]
        os.environ[STEP_OVERLAP_ENV] = "1" if mode == "overlap" else "0"
        cfg = ds_config(stage, gas=2, clip=0.5, dtype=dtype, lr=1e-3 if dtype == "bf16" else 1e-2, bucket=40,
                        extra_zero={"allgather_bucket_size": 100, "overlap_comm": True})
        model = build_model(0)
        eng, _, _, _ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        log: list[int] = []
        _probe_buckets(eng, log)
        micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
        losses = []
        for batch in batches(STEPS, micro * gas * world_size):
            for k in range(gas):
                loss = eng(*micro_batch(batch, k, rank, world_size, micro))
                eng.backward(loss)
                eng.step()
                losses.append(loss.item())
        state = {f"master.{k}": v for k, v in eng.fp32_state_dict().items()}
        state.update({f"param.{i}": p.data.float() for i, p in enumerate(eng.trainable)})
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / f"{name}.rank{rank}.safetensors"))
        (out / f"{name}.rank{rank}.json").write_text(json.dumps({
            "losses": losses, "in_flight_at_done": log, "units": len(eng.table.units),
            "left": len(eng.mgr._gathers)}))
    freed = {f"{stage}{how}": _freed(stage, how) for stage in (2, 3) for how in ("_destroy", "", "_keep_model")
             if not (stage == 3 and how == "_keep_model")}
    (out / f"freed.rank{rank}.json").write_text(json.dumps(freed))


def _freed(stage: int, how: str) -> bool:
    """Is a dropped engine garbage? ``_destroy``: after ``destroy()``; ``""``: engine and model dropped, no
    ``destroy()`` (the gradient hooks live in C++ and hold the manager weakly); ``_keep_model`` (stage 2): the user
    keeps the model, drops the engine."""
    import gc
    import weakref

    import engine

    model = build_model(0)
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=ds_config(stage))
    loss = eng(*micro_batch(batches(1, 4)[0], 0, 0, 2, 2))
    eng.backward(loss)
    eng.step()
    ref = weakref.ref(eng.mgr)
    if how == "_destroy":
        eng.destroy()
    del eng, loss, _
    if how != "_keep_model":
        del model
    gc.collect()
    return ref() is None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_overlap")
    launch(run_settings, 2, out, list(SETTINGS))

    def get(name, rank):
        return (json.loads((out / f"{name}.rank{rank}.json").read_text()),
                load_file(str(out / f"{name}.rank{rank}.safetensors")))
    get.out = out
    return get


def test_dropped_engine_is_freed(results):
    out = results.out
    for rank in range(2):
        assert json.loads((out / f"freed.rank{rank}.json").read_text()) == {
            "2_destroy": True, "2": True, "2_keep_model": True, "3_destroy": True, "3": True}


@pytest.mark.parametrize("name", [n for n in SETTINGS if n.endswith("_overlap")])
def test_overlap_is_bit_identical_to_sync(results, name):
    for rank in range(2):
        got, got_state = results(name, rank)
        want, want_state = results(name.replace("_overlap", "_sync"), rank)
        assert got["losses"] == want["losses"]
        assert got_state.keys() == want_state.keys()
        for key in want_state:
            assert torch.equal(got_state[key], want_state[key]), (name, rank, key)


@pytest.mark.parametrize("name", [n for n in SETTINGS if n.endswith("_overlap")])
def test_next_bucket_is_stepped_while_previous_all_gathers_are_in_flight(results, name):
    info, _ = results(name, 0)
    sync, _ = results(name.replace("_overlap", "_sync"), 0)
    assert sync["in_flight_at_done"] == []  # overlap off: no buckets at all
    assert info["units"] >= 4 and info["left"] == 0
    per_step = len(info["in_flight_at_done"]) // STEPS
    assert per_step >= 3
    for step in range(STEPS):
        log = info["in_flight_at_done"][step * per_step:(step + 1) * per_step]
        assert log[0] == 0 and all(n > 0 for n in log[1:]), log
