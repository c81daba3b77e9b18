"""Stage-3 communication schedule: prefetch really happens, and it never changes a bit.

One spawned world of 2 ranks trains the toy model (tied weights, a frozen parameter, a block applied twice) under
several communication settings; the parent checks that losses and final fp32 weights are *bit-identical* across
settings and match single-process PyTorch, and that with ``overlap_comm`` the all-gather of the next module's unit
is issued -- its handle still outstanding -- while the current module computes, in forward and in backward.
The trace bookkeeping (:mod:`engine.zero.prefetch`) is pure and tested without processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _engine_harness import batches, build_model, ds_config, launch, micro_batch, reference_train

from engine.zero.prefetch import FetchTrace, Stage3Options

STEPS = 3
SETTINGS = {
    "sync": {"overlap_comm": False},
    "overlap": {"overlap_comm": True},
    # released after forward, re-gathered (prefetched in reverse order) in backward
    "overlap_no_reuse": {"overlap_comm": True, "stage3_max_reuse_distance": 0},
    # prefetch only ~one small unit ahead, tight live budget, reduce-scatters waited almost at once
    "overlap_tight": {"overlap_comm": True, "stage3_prefetch_bucket_size": 48, "stage3_max_live_parameters": 200,
                      "stage3_max_reuse_distance": 0, "reduce_bucket_size": 64},
}


def _cfg(extra_zero: dict) -> dict:
    return ds_config(3, gas=2, clip=0.5, extra_zero=extra_zero)


def _unit_of(mgr, param) -> int:
    return mgr.table.param_unit[param._zero_index]


def _probe(eng, model, log: list):
    """While ``blocks[0].up`` computes (its post-forward hook, registered after the engine's), is the all-gather of
    ``blocks[0].down``'s unit issued and not yet waited? Same in backward for the reverse order: while
    ``blocks[0].down`` runs its backward (its weight's grad hook), is ``up``'s unit in flight or gathered?"""
    mgr = eng.mgr
    up, down = model.blocks[0].up, model.blocks[0].down
    u_up, u_down = _unit_of(mgr, up.weight), _unit_of(mgr, down.weight)

    def fwd_hook(_m, _i, _o):
        log.append(("fwd", mgr.full[u_down] is not None, mgr.pending[u_down] is not None))

    def grad_hook(_p):
        log.append(("bwd", mgr.full[u_up] is not None, mgr.pending[u_up] is not None))
    return [up.register_forward_hook(fwd_hook), down.weight.register_post_accumulate_grad_hook(grad_hook)]


def run_settings(rank: int, world_size: int, out: Path, names: list[str]) -> None:
    import engine

    for name in names:
        cfg = _cfg(SETTINGS[name])
        model = build_model(0)
        eng, _, _, _ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        eng.mgr.set_options(Stage3Options.from_zero_config(eng.config.zero))
        micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
        losses, probes, stats = [], [], []
        for step, batch in enumerate(batches(STEPS, micro * gas * world_size)):
            step_losses = []
            for k in range(gas):
                log: list = []
                handles = _probe(eng, model, log) if step == 1 else []
                before = dict(eng.mgr.stats)
                loss = eng(*micro_batch(batch, k, rank, world_size, micro))
                eng.backward(loss)
                eng.step()
                for h in handles:
                    h.remove()
                probes.append(log)
                stats.append({key: eng.mgr.stats[key] - before.get(key, 0) for key in eng.mgr.stats})
                step_losses.append(loss.item())
            losses.append(step_losses)
        state = eng.fp32_state_dict()
        if rank == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, str(out / f"{name}.safetensors"))
        (out / f"{name}.rank{rank}.json").write_text(json.dumps({
            "losses": losses, "probes": probes, "stats": stats, "live": eng.mgr.live_numel,
            "trace_invalidations": eng.mgr.trace.invalidations}))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("stage3_overlap")
    launch(run_settings, 2, out, list(SETTINGS))

    def get(name):
        ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)]
        return ranks, load_file(str(out / f"{name}.safetensors"))
    return get


@pytest.mark.parametrize("name", [n for n in SETTINGS if n != "sync"])
def test_overlap_is_bit_identical_to_sync(results, name):
    sync_ranks, sync_state = results("sync")
    ranks, state = results(name)
    for r in range(2):
        assert ranks[r]["losses"] == sync_ranks[r]["losses"], (name, r)
    assert state.keys() == sync_state.keys()
    for key in state:
        assert torch.equal(state[key], sync_state[key]), (name, key)


def test_sync_matches_single_process_pytorch(results):
    ranks, state = results("sync")
    ref_losses, ref_state = reference_train(_cfg({}), STEPS, 2)
    for step in range(STEPS):
        for k in range(2):
            for r in range(2):
                assert ranks[r]["losses"][step][k] == pytest.approx(ref_losses[step][k * 2 + r], rel=1e-6, abs=1e-6)
    for name, want in ref_state.items():
        if name != "head.weight":
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6)


def test_next_unit_is_in_flight_while_current_computes(results):
    """Step 1 replays the trace recorded in step 0: the next unit's all-gather handle is outstanding."""
    for r, rank in enumerate(results("overlap")[0]):
        fwd = [p for log in rank["probes"] for p in log if p[0] == "fwd"]
        assert fwd and all(issued and outstanding for _, issued, outstanding in fwd), (r, fwd)
        assert rank["trace_invalidations"] == 0
    for r, rank in enumerate(results("overlap_no_reuse")[0]):
        bwd = [p for log in rank["probes"] for p in log if p[0] == "bwd"]
        assert bwd and all(issued for _, issued, _ in bwd), (r, bwd)


def test_sync_never_prefetches(results):
    for rank in results("sync")[0]:
        fwd = [p for log in rank["probes"] for p in log if p[0] == "fwd"]
        assert fwd and not any(issued for _, issued, _ in fwd)
        assert all(s.get("prefetched", 0) == 0 for s in rank["stats"])


def test_prefetch_counts_and_reuse(results):
    """First micro-step records (no prefetch); later ones prefetch, and with DeepSpeed's default reuse distance each
    unit is gathered once per micro-step instead of twice (forward and backward)."""
    n_units = None
    for name in ("overlap", "overlap_no_reuse", "overlap_tight"):
        for rank in results(name)[0]:
            first, later = rank["stats"][0], rank["stats"][1:]
            assert first.get("prefetched", 0) == 0
            assert all(s["prefetched"] > 0 and s["prefetch_hits"] > 0 for s in later), (name, later)
            assert rank["live"] == 0  # nothing left gathered between steps (persistence threshold 0)
            if name == "overlap":
                n_units = later[0]["all_gathers"]
            elif name == "overlap_no_reuse":
                assert later[0]["all_gathers"] > n_units


# -- the trace, without processes -------------------------------------------------------------------------------
def test_trace_records_replays_and_invalidates():
    trace = FetchTrace([10, 20, 30, 40])
    trace.start_pass(True)
    for ev in [(0,), (1,), (2, 3), (1,), (0,)]:
        assert trace.event(ev) is False  # recording
    trace.end_pass()
    trace.start_pass(True)
    assert trace.event((0,)) and trace.event((1,))
    assert [units for _, units in trace.upcoming(0)] == [(2, 3), (1,), (0,)]
    assert trace.reuse(1) == (3, 70)  # next use at event 3, after units 2 and 3 (30 + 40 elements)
    assert trace.reuse(0) == (4, 90)
    assert trace.event((3,)) is False  # mismatch: dropped, nothing upcoming, re-recorded next pass
    assert list(trace.upcoming(0)) == [] and trace.reuse(1) is None and trace.invalidations == 1
    trace.start_pass(False)  # another mode records its own trace
    trace.event((2,))
    trace.start_pass(False)
    assert trace.event((2,)) and list(trace.upcoming(0)) == []


def test_options_from_zero_config():
    class Zero:  # DeepSpeed JSON names
        overlap_comm = False
        stage3_prefetch_bucket_size = 7
        stage3_max_live_parameters = 8
        stage3_max_reuse_distance = 9
        reduce_bucket_size = 10
    opts = Stage3Options.from_zero_config(Zero())
    assert (opts.overlap_comm, opts.prefetch_bucket_size, opts.max_live_parameters, opts.max_reuse_distance,
            opts.reduce_bucket_size) == (False, 7, 8, 9, 10)
    assert Stage3Options.from_zero_config(object()) == Stage3Options()
