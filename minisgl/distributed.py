"""Tensor-parallel process state and the two collectives the model needs.

With a world of one (the default) every function here is a no-op and torch.distributed is never
touched, so single-process runs need no rendezvous. Layers receive their rank and size
explicitly (weights are sharded per rank at load time); only the collectives come from here.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class TPState:
    rank: int = 0
    size: int = 1


_STATE = TPState()


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str = "tcp://127.0.0.1:29500",
    device: str = "auto",
    backend: str | None = None,
    timeout_s: float = 600.0,
    store: dist.TCPStore | None = None,
) -> None:
    """Join the tensor-parallel group: gloo on CPU, NCCL on CUDA (unless `backend` says).
    With `store` (every rank's, see `rendezvous_store`) `init_method` is not used."""
    if world_size == 1:
        _STATE.rank, _STATE.size = rank, world_size
        return
    backend = backend or default_backend(device)
    dist.init_process_group(
        backend=backend,
        init_method=init_method if store is None else None,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    _STATE.rank, _STATE.size = rank, world_size  # only once joined: a failed join leaves none
    logger.info(
        "tensor parallel: rank %d of %d (%s, %s)",
        rank,
        world_size,
        backend,
        init_method if store is None else f"store port {store.port}",
    )


def default_backend(device: str) -> str:
    on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return "nccl" if on_cuda else "gloo"


def rendezvous_store(
    host: str, port: int, world_size: int, rank: int, timeout_s: float = 600.0
) -> dist.TCPStore:
    """The group's key-value store (torch's TCPStore): rank 0 serves it, the others connect.
    Rank 0 listens on `host`'s address alone (torch's own listener takes every interface, and
    the store has no key), on `port` or, at 0, the kernel's pick (see the store's `.port`)."""
    listen_fd = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's listener
            sock.bind((host, port))
            sock.listen(1024)
            port, listen_fd = sock.getsockname()[1], sock.detach()  # the store closes it
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def destroy_distributed() -> None:
    if _STATE.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _STATE.rank, _STATE.size = 0, 1


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; the identity with one rank."""
    if _STATE.size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, rank order; the identity with one rank."""
    if _STATE.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
