"""Load-time resharding (``engine.load_checkpoint`` on a checkpoint of another world size, stage or layout).

The engine trains 3 steps at world size 2 and saves; fresh engines at world sizes 3 and 1 (another init) load it with
no offline step, and right after the load their gathered fp32 masters, Adam moments and steps are the saved ones bit
for bit; they train 3 more steps, and the losses equal those of the run that continued at world size 2 (same global
batches: 6 samples = 2 ranks x 3 = 3 ranks x 2) to fp32 reduction-order noise. A real DeepSpeed checkpoint loads the
same way (same plan API): weights equal ``zckpt.load_state_dict`` bit for bit, moments and step carried.

Each world size is one launch running every scenario; the larger matrix and an 8-rank run are marked slow.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _engine_harness import build_model, ds_config, engine_train, launch

GLOBAL_BATCH = 6  # divisible by 1, 2, 3 (and 6); the 8-rank run uses 8
SCHED = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5,
                                        "warmup_type": "linear"}}
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed"


@dataclass(frozen=True)
class Case:
    name: str
    stage: int
    dtype: str
    target_stage: int | None = None  # the loading run's stage (default: the same)

    @property
    def load_stage(self) -> int:
        return self.stage if self.target_stage is None else self.target_stage


FAST = [Case("s1", 1, "fp32"), Case("s2", 2, "fp32"), Case("s3", 3, "fp32"), Case("s3_bf16", 3, "bf16"),
        Case("s2_to_s3", 2, "fp32", 3)]
FAST_WS1 = [Case("s1", 1, "fp32"), Case("s2_to_s3", 2, "fp32", 3)]
SLOW = [Case(f"s{s}_{d}", s, d) for s in (0, 1, 2, 3) for d in ("fp32", "bf16", "fp16")] + [
    Case("s0_to_s3", 0, "fp32", 3), Case("s3_to_s1", 3, "fp32", 1), Case("s1_to_s2_bf16", 1, "bf16", 2),
    Case("s3_to_s0", 3, "bf16", 0)]


def _cfg(stage: int, world_size: int, dtype: str, global_batch: int = GLOBAL_BATCH) -> dict:
    return ds_config(stage, micro=global_batch // world_size, dtype=dtype, clip=1.0, scheduler=SCHED)


def _engine(stage: int, world_size: int, dtype: str, seed: int, global_batch: int = GLOBAL_BATCH):
    import engine

    model = build_model(seed)
    eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(),
                                config=_cfg(stage, world_size, dtype, global_batch))
    return eng


def _full_state(eng) -> tuple[dict[str, torch.Tensor], list]:
    """Collective. Gathered fp32 masters (+ frozen, buffers) and Adam moments by name; the per-group steps."""
    from engine.checkpoint import gather_optimizer_state

    out = {f"w/{k}": v.contiguous() for k, v in eng.fp32_state_dict().items()}
    state = gather_optimizer_state(eng._checkpoint_view())
    for key, per_param in state.items():
        if key != "step":
            out.update({f"{key}/{k}": v.contiguous() for k, v in per_param.items()})
    return out, state["step"]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _capture_log() -> _Lines:
    handler = _Lines()
    log = logging.getLogger("engine.checkpoint")
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    return handler


# -- workers ----------------------------------------------------------------------------------------------------
def train_worker(rank: int, world_size: int, out: Path, cases: list[dict], global_batch: int) -> None:
    """World size 2: train 3 steps, save, record the full state; continue 3 steps (the reference losses)."""
    for case in map(lambda c: Case(**c), cases):
        d = out / case.name
        cfg = _cfg(case.stage, world_size, case.dtype, global_batch)
        eng = _engine(case.stage, world_size, case.dtype, 0, global_batch)
        engine_train(eng, cfg, 3, world_size, rank)
        eng.save_checkpoint(d / "ckpt", client_state={"case": case.name})
        state, steps = _full_state(eng)
        lr = eng.get_lr()
        cont = engine_train(eng, cfg, 3, world_size, rank, start_step=3)
        if rank == 0:
            save_file(state, str(d / "saved.safetensors"))
        (d / f"train.rank{rank}.json").write_text(json.dumps({"cont": cont, "steps": steps, "lr": lr}))


def resume_worker(rank: int, world_size: int, out: Path, cases: list[dict], global_batch: int) -> None:
    """Another world size: load each case's checkpoint (resharded), compare the full state, train 3 more steps."""
    log = _capture_log()
    for case in map(lambda c: Case(**c), cases):
        d = out / case.name
        cfg = _cfg(case.load_stage, world_size, case.dtype, global_batch)
        eng = _engine(case.load_stage, world_size, case.dtype, 99, global_batch)  # another init
        del log.lines[:]
        path, client = eng.load_checkpoint(d / "ckpt")
        state, steps = _full_state(eng)
        report = {"path": path, "client": client, "global_steps": eng.global_steps, "steps": steps,
                  "lr": eng.get_lr(), "log": list(log.lines)}
        saved = load_file(str(d / "saved.safetensors"))
        report["keys_equal"] = set(saved) == set(state)
        report["mismatched"] = [k for k in saved if k in state and not torch.equal(saved[k], state[k])]
        report["resumed"] = engine_train(eng, cfg, 3, world_size, rank, start_step=3)
        (d / f"resume.ws{world_size}.rank{rank}.json").write_text(json.dumps(report))


def weights_only_worker(rank: int, world_size: int, out: Path) -> None:
    """A source without optimizer state: refused with load_optimizer_states, loaded with load_module_only."""
    from engine import comm
    from engine.checkpoint import CheckpointError

    src, dst = out / "s2" / "ckpt", out / "weights_only"
    if rank == 0:
        shutil.copytree(src, dst)
        tag = dst / "global_step3"
        manifest = json.loads((tag / "manifest.json").read_text())
        for name in [n for n, meta in manifest["files"].items() if meta["role"] == "optim"]:
            del manifest["files"][name]
            (tag / name).unlink()
        (tag / "manifest.json").write_text(json.dumps(manifest, indent=1))
        from engine import checkpoint_format as spec  # re-commit: COMMITTED records the manifest's sha256

        (tag / spec.COMMITTED).write_bytes(spec.committed_text("global_step3", (tag / "manifest.json").read_bytes()))
    comm.barrier()
    eng = _engine(2, world_size, "fp32", 99)
    report = {}
    try:
        eng.load_checkpoint(dst)
        report["error"] = None
    except CheckpointError as exc:
        report["error"] = str(exc)
    eng.load_checkpoint(dst, load_module_only=True)
    state, _ = _full_state(eng)
    saved = load_file(str(out / "s2" / "saved.safetensors"))
    report["weights_equal"] = all(torch.equal(saved[k], v) for k, v in state.items() if k.startswith("w/"))
    report["has_moments"] = any(k.startswith("exp_avg") for k in state)
    (out / f"weights_only.rank{rank}.json").write_text(json.dumps(report))


def deepspeed_worker(rank: int, world_size: int, out: Path, fixtures: list[str]) -> None:
    """Load real DeepSpeed checkpoints (2 ranks) into the engine at ``world_size`` with the same config."""
    import engine
    from transformers import LlamaConfig, LlamaForCausalLM

    import zckpt
    from zckpt.assemble import FileCache
    from zckpt.readers import open_plan
    from zckpt.tensors import read_tensor

    log = _capture_log()
    for name in fixtures:
        fixture = FIXTURES / name
        meta = json.loads((fixture / "meta.json").read_text())
        torch.manual_seed(1)  # not the fixture's init: everything must come from the checkpoint
        model = LlamaForCausalLM(LlamaConfig.from_json_file(fixture / "config.json"))
        if meta.get("buffers"):  # as make_deepspeed_fixtures registers them (other values: they are loaded)
            model.model.register_buffer("pos_scale", torch.zeros(37), persistent=True)
            model.model.register_buffer("seen_tokens", torch.zeros(5, dtype=torch.int64), persistent=True)
        for n, p in model.named_parameters():
            if n in meta["frozen_names"]:
                p.requires_grad_(False)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if meta["groups"] == 2:  # the HF Trainer split the fixture used
            decay = [p for n, p in trainable if p.ndim >= 2 and not n.endswith(".bias")]
            rest = [p for n, p in trainable if not (p.ndim >= 2 and not n.endswith(".bias"))]
            params = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
        else:
            params = [p for _, p in trainable]
        eng, *_ = engine.initialize(model=model, model_parameters=params, config=meta["ds_config"])
        del log.lines[:]
        path, _client = eng.load_checkpoint(fixture / "ckpt")
        state, steps = _full_state(eng)
        report = {"path": path, "global_steps": eng.global_steps, "steps": steps, "log": list(log.lines)}
        ref = zckpt.load_state_dict(fixture / "ckpt", "fp32")
        plan = open_plan(fixture / "ckpt")
        files = FileCache()
        want = {f"w/{n}": t for n, t in ref.items() if n not in plan.aliases}
        for t in plan.tensors:
            for key in (s.key for s in t.state):
                want[f"{key}/{t.name}"] = read_tensor(t.state_tensor(key), files).float()
        report["plan_steps"] = [float(read_tensor(s, files)) for g in plan.training.groups for s in g.scalars
                                if s.name == "step"]
        report["compared"] = sorted(k for k in state if k in want)
        report["missing"] = sorted(k for k in want if k not in state)
        report["mismatched"] = [k for k in report["compared"] if not torch.equal(state[k], want[k].to(state[k].dtype))]
        report["n_moments"] = sum(k.startswith("exp_avg/") for k in report["compared"])
        files.close()
        (out / f"ds_{name}.rank{rank}.json").write_text(json.dumps(report))


# -- fixtures and checks ----------------------------------------------------------------------------------------
def _global_losses(per_rank: list[list[list[float]]]) -> list[float]:
    """Mean over ranks of each step's loss (equal micro-batch sizes: the global batch's mean loss)."""
    return [sum(r[s][0] for r in per_rank) / len(per_rank) for s in range(len(per_rank[0]))]


def _train(out: Path, cases: list[Case], global_batch: int = GLOBAL_BATCH) -> Path:
    launch(train_worker, 2, out, [asdict(c) for c in cases], global_batch)
    return out


def _check_resumed(out: Path, cases: list[Case], world_size: int, source_ws: int = 2) -> None:
    for case in cases:
        d = out / case.name
        train = [json.loads((d / f"train.rank{r}.json").read_text()) for r in range(source_ws)]
        resume = [json.loads((d / f"resume.ws{world_size}.rank{r}.json").read_text()) for r in range(world_size)]
        for r in resume:
            assert r["keys_equal"] and r["mismatched"] == [], (case, r["mismatched"][:5])
            assert r["steps"] == train[0]["steps"] and r["steps"][0] == 3.0, case
            assert r["global_steps"] == 3 and r["client"] == {"case": case.name}
            assert r["lr"] == train[0]["lr"]
        assert resume[0]["log"] == [f"resharded {resume[0]['path']}: " + ", ".join(
            part for part in (f"world size {source_ws} -> {world_size}" if world_size != source_ws else "",
                              f"stage {case.stage} -> {case.load_stage}" if case.load_stage != case.stage else "")
            if part) + " (engine-native)"], resume[0]["log"]
        assert all(r["log"] == [] for r in resume[1:])
        cont = _global_losses([t["cont"] for t in train])
        resumed = _global_losses([r["resumed"] for r in resume])
        tol = 1e-5 if case.dtype == "fp32" else 2e-2  # 16-bit compute: per-rank micro-batches round differently
        assert resumed == pytest.approx(cont, rel=tol), case


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("reshard_load"), FAST)


def ws3_worker(rank: int, world_size: int, out: Path, cases: list[dict], fixtures: list[str]) -> None:
    """Everything the default suite runs at world size 3, in one process group (one start-up)."""
    resume_worker(rank, world_size, out, cases, GLOBAL_BATCH)
    weights_only_worker(rank, world_size, out)
    deepspeed_worker(rank, world_size, out, fixtures)


DS_FAST = ["z2_bf16_ws2_tied_g2", "z3_bf16_ws2_tied"]


@pytest.fixture(scope="module")
def at_ws3(trained):
    launch(ws3_worker, 3, trained, [asdict(c) for c in FAST], DS_FAST)
    return trained


def test_load_at_world_size_3_reshards_exactly(at_ws3):
    _check_resumed(at_ws3, FAST, 3)


def ws1_worker(rank: int, world_size: int, out: Path, cases: list[dict]) -> None:
    """World size 1: resume, then the refusals: a corrupt file, another model."""
    import engine
    from engine.checkpoint import CheckpointError
    from _engine_harness import ToyModel

    resume_worker(rank, world_size, out, cases, GLOBAL_BATCH)
    errors = {}
    bad = out / "corrupt"
    shutil.copytree(out / "s2" / "ckpt", bad)
    path = bad / "global_step3" / "rank00001-optim.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    model = ToyModel(layers=3)
    model.frozen_proj.requires_grad_(False)
    other, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=_cfg(2, 1, "fp32"))
    for name, eng, src in (("corrupt", _engine(2, 1, "fp32", 99), bad), ("other_model", other, out / "s2" / "ckpt")):
        try:
            eng.load_checkpoint(src)
            errors[name] = None
        except CheckpointError as exc:
            errors[name] = str(exc)
    (out / "ws1_errors.json").write_text(json.dumps(errors))


def test_load_at_world_size_1_reshards_exactly(trained):
    launch(ws1_worker, 1, trained, [asdict(c) for c in FAST_WS1])
    _check_resumed(trained, FAST_WS1, 1)
    errors = json.loads((trained / "ws1_errors.json").read_text())
    assert "rank00001-optim.safetensors does not match the sha256" in errors["corrupt"]
    assert "missing 5 ['blocks.2.norm.weight'" in errors["other_model"] and "unexpected 0" in errors["other_model"]


def test_weights_only_source_needs_load_module_only(at_ws3):
    for r in range(3):
        report = json.loads((at_ws3 / f"weights_only.rank{r}.json").read_text())
        assert "only the weights" in report["error"] and "load_module_only=True" in report["error"]
        assert report["weights_equal"] and not report["has_moments"]


def _check_deepspeed(out: Path, name: str, world_size: int) -> None:
    meta = json.loads((FIXTURES / name / "meta.json").read_text())
    for r in range(world_size):
        report = json.loads((out / f"ds_{name}.rank{r}.json").read_text())
        assert report["mismatched"] == [] and report["missing"] == [], report
        assert report["n_moments"] == len(meta["param_names"]) - len(meta["frozen_names"])
        assert report["steps"] == report["plan_steps"] and set(report["steps"]) == {3.0}
        assert report["global_steps"] == meta["global_steps"]
        expected = f"world size {meta['world_size']} -> {world_size}"
        assert len(report["log"]) == (r == 0) and (r or expected in report["log"][0] and "DeepSpeed" in
                                                   report["log"][0])


@pytest.mark.parametrize("name", DS_FAST)
def test_deepspeed_checkpoint_loads_at_world_size_3(at_ws3, name):
    _check_deepspeed(at_ws3, name, 3)


# -- the larger matrix ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_matrix(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("reshard_matrix"), SLOW, 12)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_matrix_reshards_exactly(trained_matrix, world_size):
    launch(resume_worker, world_size, trained_matrix, [asdict(c) for c in SLOW], 12)
    _check_resumed(trained_matrix, SLOW, world_size)


@pytest.mark.slow
def test_eight_ranks(tmp_path):
    cases = [Case("s2", 2, "fp32"), Case("s3_bf16", 3, "bf16"), Case("s1_to_s3", 1, "fp32", 3)]
    _train(tmp_path, cases, 8)
    launch(resume_worker, 8, tmp_path, [asdict(c) for c in cases], 8)
    _check_resumed(tmp_path, cases, 8)


@pytest.mark.slow
def test_deepspeed_matrix(tmp_path):
    names = ["z1_fp32_ws3_tied_g2", "z2_fp32_ws2_frozen", "z3_bf16_ws2_frozen", "z3_fp32_ws2_untied_g2",
             "z2_bf16_ws2_buffers", "z3_fp16_ws2_tied"]
    launch(deepspeed_worker, 4, tmp_path, names)
    for name in names:
        _check_deepspeed(tmp_path, name, 4)
