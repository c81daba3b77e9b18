"""Native checkpoints under faults (../shared/PEERS.md, "Faults a trusted checkpoint system survives"): a rank dying
after the rank files are written but before the commit, re-saving an existing tag, a foreign directory under the
tag's name, ranks disagreeing on the tag. 2 gloo ranks, stage 2."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from _engine_harness import WorkerFailed, build_model, ds_config, engine_train, launch

CFG = ds_config(2)


def _engine(seed: int):
    import engine

    model = build_model(seed)
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    return eng


def crash_worker(rank: int, world_size: int, out: Path) -> None:
    """Save 'good', then die on rank 0 inside the commit of 'bad' (all rank files written, no manifest yet)."""
    import engine.checkpoint as ckpt

    eng = _engine(0)
    engine_train(eng, CFG, 1, world_size, rank)
    eng.save_checkpoint(out / "ckpt", tag="good")
    state = eng.fp32_state_dict()  # collective
    if rank == 0:
        torch.save(state, out / "good_state.pt")
    engine_train(eng, CFG, 1, world_size, rank, start_step=1)
    if rank == 0:
        ckpt._commit = lambda *a, **k: os._exit(3)  # as kill -9 between the rank writes and the commit
    eng.save_checkpoint(out / "ckpt", tag="bad")


def recover_worker(rank: int, world_size: int, out: Path) -> None:
    """After the crash: resume from 'latest'; re-save a tag twice; a foreign dir and disagreeing tags are refused."""
    from engine.checkpoint import CheckpointError

    save_dir, report = out / "ckpt", {}
    eng = _engine(7)
    path, _ = eng.load_checkpoint(save_dir)
    report["resumed_from"] = Path(path).name
    good = torch.load(out / "good_state.pt", weights_only=True)
    report["resumed_equal"] = all(torch.equal(good[k], v) for k, v in eng.fp32_state_dict().items())
    engine_train(eng, CFG, 1, world_size, rank, start_step=1)
    eng.save_checkpoint(save_dir, tag="again")
    engine_train(eng, CFG, 1, world_size, rank, start_step=2)
    eng.save_checkpoint(save_dir, tag="again")  # replaces our own tag
    final = eng.fp32_state_dict()
    eng2 = _engine(8)
    eng2.load_checkpoint(save_dir, tag="again")
    report["resave_equal"] = all(torch.equal(final[k], v) for k, v in eng2.fp32_state_dict().items())
    if rank == 0:
        (save_dir / "foreign").mkdir()
        (save_dir / "foreign" / "keep.txt").write_text("user data")
    import engine.comm as comm

    comm.barrier()
    for name, tag in (("foreign", "foreign"), ("disagree", f"rank{rank}")):
        try:
            eng.save_checkpoint(save_dir, tag=tag)
            report[name] = None
        except CheckpointError as exc:
            report[name] = str(exc)
    (out / f"recover.rank{rank}.json").write_text(json.dumps(report))


# What rank 1 may see when rank 0 dies under it: gloo losing its peer mid-barrier (the exact words vary with the
# moment of death), or nothing at all because join() already ended it with SIGTERM.
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe")


def _assert_only_rank0_exit3(failure: WorkerFailed) -> None:
    """Rank 0's deliberate exit is the reported cause; rank 1 failed only as its consequence (a lost peer, or
    the SIGTERM that join() sends to survivors)."""
    assert (failure.primary.rank, failure.primary.exitcode, failure.primary.error) == (0, 3, None), str(failure)
    rank1 = failure.outcomes[1]
    consequence = (rank1.exitcode in (-signal.SIGTERM, -signal.SIGKILL)
                   or (rank1.error is not None and PEER_LOST.search(rank1.error)))
    assert consequence, str(failure)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults")
    with pytest.raises(WorkerFailed) as failed:
        launch(crash_worker, 2, out)
    _assert_only_rank0_exit3(failed.value)
    listing_after_crash = sorted(p.name for p in (out / "ckpt").iterdir())
    listing_after_crash.append("latest=" + (out / "ckpt" / "latest").read_text().strip())
    launch(recover_worker, 2, out)
    reports = [json.loads((out / f"recover.rank{r}.json").read_text()) for r in range(2)]
    return out, listing_after_crash, reports


def test_crash_before_commit_leaves_latest_on_the_last_good_tag(run):
    out, listing, _ = run
    assert "bad" not in listing and "good" in listing
    assert "latest=good" in listing
    leftovers = [n for n in listing if n.startswith(".bad.tmp-")]
    assert len(leftovers) == 1 and not (out / "ckpt" / leftovers[0] / "COMMITTED").exists()

    from zckpt import load_state_dict

    good = torch.load(out / "good_state.pt", weights_only=True)
    got = load_state_dict(out / "ckpt" / "good", "fp32")
    assert all(torch.equal(got[k], good[k]) for k in good)


def test_resume_after_crash_and_resave_same_tag(run):
    out, _, reports = run
    for r in reports:
        assert r["resumed_from"] == "good" and r["resumed_equal"]
        assert r["resave_equal"]
    names = sorted(p.name for p in (out / "ckpt").iterdir())
    # no temp or old copy of 'again' left, and the next save removed the killed save's '.bad.tmp-*' staging
    assert names == ["again", "foreign", "good", "latest"], names
    assert (out / "ckpt" / "latest").read_text().strip() == "again"


def test_foreign_dir_and_disagreeing_tags_are_refused_on_every_rank(run):
    out, _, reports = run
    for r in reports:
        assert r["foreign"] and "not an engine checkpoint" in r["foreign"]
        assert r["disagree"] and "ranks disagree" in r["disagree"] and "rank0" in r["disagree"]
    assert (out / "ckpt" / "foreign" / "keep.txt").read_text() == "user data"
    assert not (out / "ckpt" / "rank0").exists() and not (out / "ckpt" / "rank1").exists()


def test_stale_staging_removed_only_when_it_holds_checkpoint_files(tmp_path):
    from engine.checkpoint import remove_stale_staging

    stale = tmp_path / ".step9.tmp-ab_12"
    stale.mkdir()
    (stale / "rank00000-weights.safetensors").write_bytes(b"x")
    (stale / ".done-rank0.json").write_text("{}")
    old = tmp_path / ".step8.old-zz"
    old.mkdir()
    (old / "manifest.json").write_text("{}")
    foreign = tmp_path / ".step7.tmp-cd"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("user data")
    (tmp_path / ".hidden.tmp-file").write_text("a file, not a folder")
    (tmp_path / "step6").mkdir()
    assert sorted(remove_stale_staging(tmp_path)) == [".step8.old-zz", ".step9.tmp-ab_12"]
    assert (foreign / "notes.txt").read_text() == "user data"
    assert (tmp_path / ".hidden.tmp-file").is_file() and (tmp_path / "step6").is_dir()
