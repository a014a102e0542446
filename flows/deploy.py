"""The scheduled deployment against the server in PREFECT_API_URL: `flow.serve` runs it in this process (one
machine), or `deploy_to_pool` registers it with a process work pool so that `prefect worker start --pool NAME`
runs it on any machine that has this package installed and the workspace mounted."""

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


ENTRYPOINT = "flows.ulmfit:ulmfit_flow"  # a module path: the worker imports it from the installed package


def deploy_to_pool(pool: str, params_path: str = "params.yaml", overrides: list[str] | None = None,
                   cron: str | None = None) -> str:
    """Create process work pool `pool` if missing and (re)deploy the flow to it with its cron schedule; the
    worker runs each flow run in this workspace (its working directory). Returns the deployment id."""
    from prefect import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate, WorkPoolCreate
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.exceptions import ObjectNotFound
    from prefect.utilities.callables import parameter_schema

    p = load_params(params_path, overrides or [])
    workspace = str(Path.cwd().resolve())
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        flow_id = client.create_flow(ulmfit_flow)
        name = p.schedule.deployment_name
        previous = [d for d in client.read_deployments() if d.name == name and d.flow_id == flow_id]
        for d in previous:  # a rerun replaces the deployment (and its schedule) rather than adding a second one
            client.delete_deployment(d.id)
        deployment_id = client.create_deployment(
            flow_id=flow_id, name=name, work_pool_name=pool, entrypoint=ENTRYPOINT, path=workspace,
            parameters={"params_path": params_path, "overrides": list(overrides or []), "root": workspace},
            parameter_openapi_schema=parameter_schema(ulmfit_flow).model_dump_for_openapi(),
            schedules=[DeploymentScheduleCreate(schedule=CronSchedule(cron=cron or p.schedule.cron), active=True)],
            job_variables={"working_dir": workspace,
                           "env": {"PREFECT_LOCAL_STORAGE_PATH": str(Path(workspace) / ".prefect-results")}},
            description="Nightly ULMFiT retraining on a work pool: cached stages are skipped; the promotion gate "
                        "picks the champion.",
        )
    return str(deployment_id)
