"""Process-group plumbing for torchrun (DDP) and the deepspeed launcher: one code path for both.

Both launchers export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, so the trainer reads
those and never needs to know which launcher started it. Without them it is a plain single process.

Gradient averaging is done by hand (`all_reduce_grads`) rather than by wrapping the model in
`DistributedDataParallel`: the set of trainable parameters changes mid-run (Medusa-2 warms the heads up
before LoRA joins), and Medusa-1 runs the backbone under `no_grad`, both of which DDP's reducer handles
only with `find_unused_parameters` and a rebuilt wrapper. One flattened all-reduce per optimizer step
gives the same averaged gradient as DDP's buckets; at head/LoRA sizes (a few million parameters) the
missing compute/communication overlap costs nothing measurable.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: single process

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup(use_deepspeed: bool = False) -> DistEnv:
    """Join the process group the launcher prepared (gloo on CPU, NCCL on GPUs)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world == 1 and not use_deepspeed:
        return DistEnv(device=device)
    backend = "nccl" if cuda else "gloo"
    if use_deepspeed:
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
    elif not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend)


def teardown(env: DistEnv) -> None:
    if env.backend is not None and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


@contextlib.contextmanager
def main_process_first(env: DistEnv) -> Iterator[None]:
    """Rank 0 runs the body first (e.g. tokenizing into the datasets cache), the others then reuse it."""
    if not env.is_main:
        barrier(env)
    yield
    if env.is_main:
        barrier(env)


def broadcast_params(env: DistEnv, params: list[torch.nn.Parameter]) -> None:
    """Start every rank from rank 0's weights (what DDP does at construction)."""
    if env.distributed:
        for p in params:
            dist.broadcast(p.data, src=0)


def all_reduce_grads(env: DistEnv, params: list[torch.nn.Parameter]) -> None:
    """Average gradients over ranks with one flat all-reduce (params without a grad are skipped)."""
    if not env.distributed:
        return
    # A weight may have a gradient on one rank and none on another (its rows were all masked there):
    # agree on which weights have one anywhere, and give the others zeros, so the flat buffers line up.
    present = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device if params else "cpu")
    dist.all_reduce(present, op=dist.ReduceOp.SUM)
    for p, anywhere in zip(params, present.tolist(), strict=True):
        if anywhere and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= env.world_size
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def mean_over_ranks(env: DistEnv, values: torch.Tensor) -> torch.Tensor:
    if env.distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= env.world_size
    return values


def sum_over_ranks(env: DistEnv, values: torch.Tensor) -> torch.Tensor:
    if env.distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def params_checksum(params: list[torch.Tensor]) -> str:
    """Exact fingerprint of parameter bytes (to prove every rank ends with identical weights)."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def gather_strings(env: DistEnv, value: str) -> list[str]:
    if not env.distributed:
        return [value]
    out: list[str | None] = [None] * env.world_size
    dist.all_gather_object(out, value)
    return [str(v) for v in out]
