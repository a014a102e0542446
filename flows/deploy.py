"""The scheduled deployment: `flow.serve` with a cron schedule against the server in PREFECT_API_URL."""

from __future__ import annotations

import os
from pathlib import Path

from transfer.config import load_params

from flows.ulmfit import ulmfit_flow


def serve_scheduled(params_path: str = "params.yaml", overrides: list[str] | None = None,
                    cron: str | None = None) -> None:
    """Register the deployment and run its flow runs in this process until stopped (Ctrl-C)."""
    p = load_params(params_path, overrides or [])
    # scheduled runs execute in child processes of this one: share `transfer run`'s task cache
    os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(Path(".prefect-results").resolve())
    ulmfit_flow.serve(
        name=p.schedule.deployment_name,
        cron=cron or p.schedule.cron,
        parameters={"params_path": params_path, "overrides": list(overrides or [])},
        pause_on_shutdown=False,  # a restart of this process keeps the schedule active
        description="Nightly ULMFiT retraining: cached stages are skipped; the promotion gate picks the champion.",
    )


if __name__ == "__main__":
    serve_scheduled()
