"""Shared start-up of the GPU benchmark scripts (run with torchrun; ``--cpu`` tries a script small on gloo)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_process_group(cpu: bool) -> tuple[int, int]:
    """gloo on the CPU, else NCCL on this rank's GPU (``LOCAL_RANK``); returns ``(rank, world size)``."""
    if cpu:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return dist.get_rank(), dist.get_world_size()


def report_and_exit(rank: int, result: dict) -> None:
    """Rank 0 prints the result as one JSON line; every rank leaves the process group and exits without Python's
    finalisation (a gloo thread can abort a finalising interpreter: :func:`engine.comm.exit_without_finalizing`)."""
    import json

    from engine.comm import exit_without_finalizing

    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    exit_without_finalizing()
