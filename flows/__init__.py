"""Prefect flows and the `transfer` CLI."""

import os

# Defaults for a laptop-style run on Prefect's temporary local server; the user's environment wins.
# First start of a fresh PREFECT_HOME migrates a SQLite database, which takes longer than 20 s on 2 busy cores.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network here; telemetry only logs errors

# Results are JSON, never pickles: a failed flow's exception record would otherwise be pickled into .prefect-results/
os.environ.setdefault("PREFECT_RESULTS_DEFAULT_SERIALIZER", "json")
