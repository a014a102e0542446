"""Data-parallel training with torch.distributed: who this process is, and what ranks agree on.

A stage runs the same code in every process of a job started by torch's elastic launcher (transfer/launch.py).
Each rank trains on its own share of the data (LMs: a contiguous share of the token stream, see
`transfer.data.LMLoader`; classifiers: every `world`-th sortish batch, `shard_batches`) and DDP averages the
gradients, so a job of N ranks at `bs` per rank steps like one process at N x `bs`. Rank 0 alone writes files
(`transfer.io_utils.atomic_path` drops the others' writes); every rank reads the same checkpoint to resume.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from transfer.errors import TransferError

__all__ = ["rank", "world_size", "is_main", "init", "shutdown", "wrap", "mean_over_ranks", "gather",
           "main_writes", "barrier", "shard_batches", "check_in_sync"]

T = TypeVar("T")
P = TypeVar("P", bound=Path)


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def init() -> torch.device:
    """Join the job the launcher started (env: RANK, WORLD_SIZE, MASTER_ADDR...): NCCL on CUDA, gloo on CPU.
    Returns this rank's device; on CUDA, the GPU of its local rank."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not active():
        dist.init_process_group(backend)
    return device


def shutdown() -> None:
    if active():
        dist.destroy_process_group()


def wrap(model: nn.Module) -> nn.Module:
    """DDP over the parameters that train now. Built again whenever the frozen groups change: DDP fixes the set
    of parameters it reduces when it is built, so one built in a frozen phase would never sync the groups that
    gradual unfreezing opens later, and one built with all groups would wait forever for gradients of frozen
    ones. Buffers are not broadcast: the LSTM state lives outside them, and BatchNorm statistics are recomputed
    from the same full pass on every rank after each epoch."""
    if not active():
        return model
    device_ids = [next(model.parameters()).device] if next(model.parameters()).is_cuda else None
    with warnings.catch_warnings():  # its replacement still syncs buffers at init, which we do not want
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def mean_over_ranks(value: float) -> float:
    """The mean of a per-rank float over all ranks (each rank's step loss -> the global one the guard judges, so
    every rank takes the same decision)."""
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    return float(t.item()) / world_size()


def gather(obj: T) -> list[T]:
    """Every rank's `obj` (small: an RNG state, an LSTM state), in rank order, on every rank."""
    if not active():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def check_in_sync(model: nn.Module, where: str) -> None:
    """Fail if the ranks' weights differ: DDP keeps them equal only while every trainable parameter is reduced
    (a group opened after the DDP wrapper was built, for one, would drift apart silently)."""
    if not active():
        return
    with torch.no_grad():
        digest = torch.stack([p.detach().double().sum() for p in model.parameters()]).cpu()
    digests = gather(digest)
    if any(not torch.equal(d, digests[0]) for d in digests[1:]):
        raise TransferError(f"{where}: the weights of the {len(digests)} processes differ; data-parallel training "
                            "lost its sync")


def barrier() -> None:
    if active():
        dist.barrier()


def main_writes(path: P, make: Callable[[], P]) -> P:
    """Rank 0 runs `make`, which writes `path`; every rank returns `path` once it is on disk."""
    if is_main():
        make()
    barrier()
    return path


def shard_batches(batches: Callable[[int, int], Iterator[tuple]], n_batches: int
                  ) -> tuple[Callable[[int, int], Iterator[tuple]], int]:
    """This rank's share of an epoch of `n_batches` batches: every world-th one, the same count on every rank
    (a rank with one batch more would wait forever for the others' gradients). -> (batches, steps per epoch)."""
    world, me = world_size(), rank()
    if world == 1:
        return batches, n_batches
    steps = max(1, n_batches // world)
    mine = [(k * world + me) % n_batches for k in range(steps)]  # modulo: fewer batches than ranks

    def sharded(epoch: int, start: int = 0) -> Iterator[tuple]:
        wanted = set(mine[start:])
        for i, batch in enumerate(batches(epoch, 0)):
            if i in wanted:
                yield batch
            if i >= mine[-1]:
                return

    return sharded, steps

