"""Scale-out through Dask: the task runner for independent work (benchmark cells), on the user's cluster or a
local one. Workers share the workspace through a shared filesystem (NFS, a volume mount)."""

from __future__ import annotations

import os

from transfer.errors import TransferError

__all__ = ["dask_runner", "worker_threads", "DASK_ADDRESS_ENV"]

DASK_ADDRESS_ENV = "TRANSFER_DASK_ADDRESS"


def dask_runner(address: str | None = None, workers: int | None = None):
    """A prefect-dask `DaskTaskRunner` for `address` (else $TRANSFER_DASK_ADDRESS), or for a local cluster of
    `workers` processes with one thread each; None when neither is asked for (run in order, in this process)."""
    if address and workers:
        raise TransferError("give --dask-address (a running cluster) or --workers (a local one), not both")
    if workers is not None and workers < 1:
        raise TransferError(f"--workers must be at least 1, got {workers}")
    if not workers:  # the environment's cluster, unless the command line asked for a local one
        address = address or os.environ.get(DASK_ADDRESS_ENV) or None
    if not address and not workers:
        return None
    from prefect_dask import DaskTaskRunner

    if address:
        if not address.startswith(("tcp://", "tls://", "ucx://", "inproc://")):
            raise TransferError(f"--dask-address {address!r}: expected a scheduler address like tcp://HOST:8786")
        return DaskTaskRunner(address=address)
    # processes, not threads: torch and the GIL; one thread each, and each cell sets torch to its share of cores
    return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True,
                                          "dashboard_address": None})


def worker_threads(workers: int | None) -> int | None:
    """Torch threads per task on a local cluster of `workers` processes (their share of the cores); None on a
    cluster of yours, whose workers set OMP_NUM_THREADS themselves."""
    return max(1, (os.cpu_count() or 1) // workers) if workers else None
