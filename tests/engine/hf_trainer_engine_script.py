"""Real ``transformers.Trainer`` runs under torchrun (gloo, CPU): one plain (DDP, no DeepSpeed), then one per
``--config`` whose DeepSpeed path drives the engine (``deepspeed.initialize`` replaced by ``engine.initialize``,
nothing else changed). Writes each run's logged losses and learning rates to ``--out`` as JSON (rank 0).

    torchrun --nproc_per_node 2 tests/engine/hf_trainer_engine_script.py --out /tmp/runs.json \\
        --config fixtures/hf_guide/zero1.json fixtures/hf_guide/zero2.json fixtures/hf_guide/zero3.json

Needs ``accelerate`` and ``deepspeed`` (the Trainer's DeepSpeed integration imports them).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

VOCAB, SEQ = 64, 8
MODEL = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, attention_bias=True, max_position_embeddings=SEQ)


class Rows:
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(path: str) -> dict:
    """The guide's ``zero_optimization`` snippet plus the batch keys as "auto": transformers' integration fills only
    keys that are present, and DeepSpeed (like the engine without training_args) needs a batch size."""
    cfg = json.loads(Path(path).read_text())
    cfg.update({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto", "gradient_clipping": "auto"})
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", nargs="*", default=[])
    ap.add_argument("--out", required=True)
    opts = ap.parse_args()

    import deepspeed
    import torch

    import engine

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.initialize = engine.initialize  # what accelerate's _prepare_deepspeed calls
    runs = {}
    for config in [None, *opts.config]:
        runs[Path(config).stem if config else "plain"] = train(config)
    if torch.distributed.get_rank() == 0:
        Path(opts.out).write_text(json.dumps(runs))
    torch.distributed.barrier()
    from engine.comm import exit_without_finalizing

    exit_without_finalizing(0)  # gloo teardown race at interpreter exit (see its docstring)


def train(config: str | None) -> dict:
    """One Trainer run: with ``config``, through its DeepSpeed path (here: the engine); without, plain DDP."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))  # built before TrainingArguments: no DeepSpeed zero.Init
    g = torch.Generator().manual_seed(1)
    data = Rows(torch.randint(0, VOCAB, (32, SEQ), generator=g))
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
            learning_rate=1e-2, weight_decay=0.1, adam_beta2=0.99, lr_scheduler_type="cosine", warmup_steps=2,
            max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0,
            dataloader_num_workers=0, disable_tqdm=True, use_cpu=True, ddp_backend="gloo",
            deepspeed=ds_config(config) if config else None)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    wrapped = type(trainer.model_wrapped)
    return {"loss": [e["loss"] for e in logs], "lr": [e["learning_rate"] for e in logs],
            "wrapped": f"{wrapped.__module__}.{wrapped.__name__}"}


if __name__ == "__main__":
    main()
