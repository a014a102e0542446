"""Run a training stage as a data-parallel job through torch's elastic launcher (what `torchrun` runs).

`transfer stage pretrain --nproc 2` (and `transfer run --nproc 2`) start `nproc` worker processes on this
machine; with `nnodes` > 1 and a rendezvous endpoint the same command on every machine joins one job.
Every worker runs the stage's own code (transfer/distributed.py says what differs); the launcher stops the
whole job when one worker dies, and the rerun resumes from the checkpoint rank 0 wrote.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from transfer.config import Params, dump_params, load_params
from transfer.errors import TransferError

__all__ = ["Launch", "DISTRIBUTED_STAGES", "launch_stage"]

DISTRIBUTED_STAGES = ("pretrain", "finetune_lm", "train_classifier")
LOST_PEER = 3  # a worker's exit code when a collective failed because another worker is gone


@dataclass(frozen=True)
class Launch:
    """How many processes a training stage runs on: `nproc` per machine, on `nnodes` machines ("N" or
    "MIN:MAX") that meet at `rdzv_endpoint` (HOST:PORT of one of them) under the job id `rdzv_id`."""

    nproc: int = 1
    nnodes: str = "1"
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise TransferError(f"--nproc must be at least 1, got {self.nproc}")
        lo, _, hi = self.nnodes.partition(":")
        if not (lo.isdigit() and (not hi or hi.isdigit())) or int(lo) < 1:
            raise TransferError(f"--nnodes must be N or MIN:MAX, got {self.nnodes!r}")
        if self.multi_node and not self.rdzv_endpoint:
            raise TransferError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the same on every machine)")

    @property
    def node_range(self) -> tuple[int, int]:
        lo, _, hi = self.nnodes.partition(":")
        return int(lo), int(hi or lo)

    @property
    def multi_node(self) -> bool:
        return self.node_range[1] > 1

    @property
    def distributed(self) -> bool:
        return self.nproc > 1 or self.multi_node


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def launch_stage(name: str, p: Params, root: Path, launch: Launch) -> dict:
    """Run stage `name` on `launch.nproc` processes here (and the other machines of the job); its metrics."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    lo, hi = launch.node_range
    with tempfile.TemporaryDirectory(prefix=f"transfer-{name}-") as spec_dir:
        spec = Path(spec_dir)
        dump_params(p, spec / "params.yaml")
        # torch threads per worker: this machine's cores shared out, so the workers do not oversubscribe them
        (spec / "spec.json").write_text(json.dumps(dict(root=str(Path(root).resolve()), cwd=os.getcwd(),
                                                        threads=max(1, _cores() // launch.nproc))))
        config = LaunchConfig(
            min_nodes=lo, max_nodes=hi, nproc_per_node=launch.nproc, max_restarts=0,
            rdzv_backend="c10d", rdzv_endpoint=launch.rdzv_endpoint or "localhost:0",
            run_id=launch.rdzv_id or (f"transfer-{name}" if launch.multi_node else str(uuid.uuid4())),
            monitor_interval=0.5)
        quiet = logging.getLogger("torch.distributed.elastic")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)  # the failure is reported once, below, not as the agent's log
        try:
            elastic_launch(config, sys.executable)("-m", "transfer.launch", name, spec_dir)
        except ChildFailedError as e:
            raise TransferError(_failure_message(name, e.failures, spec)) from None
        finally:
            quiet.setLevel(level)
    metrics = Path(root) / "metrics" / f"{name}.json"
    return json.loads(metrics.read_text()) if metrics.is_file() else {}


def _failure_message(name: str, failures: dict, spec: Path) -> str:
    """The worker's own error if it wrote one (a TransferError), else which rank died and how."""
    for rank in sorted(failures):
        err = spec / f"error-rank{rank}.txt"
        if err.is_file():
            return err.read_text()
    # the root cause, not the ranks that lost their peer (LOST_PEER) or that the launcher then stopped (SIGTERM)
    rank, failure = min(failures.items(), key=lambda kv: (kv[1].exitcode in (-signal.SIGTERM, LOST_PEER),
                                                          kv[1].exitcode >= 0, kv[0]))
    how = (f"was killed by {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0
           else f"exited with code {failure.exitcode} (its output is above)")
    return (f"{name}: worker rank {rank} {how}, so the launcher stopped the job; run the same command again to "
            f"resume from the last checkpoint in artifacts/{name}/")


def _worker(name: str, spec_dir: str) -> int:
    """One rank: join the job, run the stage's body in the workspace; a TransferError goes to the parent."""
    import torch

    from transfer import distributed
    from transfer.stages import STAGES, Workspace

    spec_path = Path(spec_dir)
    spec = json.loads((spec_path / "spec.json").read_text())
    torch.set_num_threads(spec["threads"])
    distributed.init()
    try:
        p = load_params(spec_path / "params.yaml")
        with contextlib.chdir(spec["cwd"]):  # the params' relative data paths
            STAGES[name].run(p, Workspace(spec["root"]))
        return 0
    except TransferError as e:
        (spec_path / f"error-rank{distributed.rank()}.txt").write_text(str(e))  # the parent prints it once
        return 2
    except RuntimeError as e:  # gloo and NCCL report a dead peer as this; the parent names the dead one
        if not isinstance(e, torch.distributed.DistError) and "gloo" not in str(e) and "NCCL" not in str(e):
            raise
        return LOST_PEER
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2]))
