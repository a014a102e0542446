"""Promotion gate: a new model version becomes `champion` only if it beats the champion on the same test data.

Every candidate version gets the alias `challenger`. It also takes `champion` when its metric reaches
`min_accuracy`, beats chance (the most frequent class) and the tfidf baseline of the same run (by
`min_delta_over_baseline`), and either there is no champion or it scores at least the champion's metric + `min_delta`
on the same test set (equal `test_digest` version tags). Scores on different test sets are not compared:
such a candidate is refused while a champion exists. An MLflow alias names one version at a time, so
moving `champion` demotes the previous holder in the same call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mlflow.entities.model_registry import ModelVersion
from mlflow.tracking import MlflowClient

from tasks.tracking import tracking_uri
from transfer.errors import TransferError

__all__ = ["CHAMPION", "CHALLENGER", "Decision", "promote", "alias_version", "version_metrics"]

CHAMPION, CHALLENGER = "champion", "challenger"
_EPS = 1e-12  # float slack so 0.8 counts as >= 0.7 + 0.1


@dataclass(frozen=True)
class Decision:
    """What `promote` decided and why; also stored as the version's promotion_* tags."""

    promoted: bool
    reason: str
    champion_version: str | None  # the champion after the decision


def alias_version(client: MlflowClient, model_name: str, alias: str) -> ModelVersion | None:
    """The version `alias` points to, or None."""
    # get_model_version_by_alias raises INVALID_PARAMETER_VALUE for a missing alias; the alias map doesn't
    version = client.get_registered_model(model_name).aliases.get(alias)
    return None if version is None else client.get_model_version(model_name, str(version))


def version_metrics(client: MlflowClient, model_name: str, version: str) -> dict[str, float]:
    """The test metrics recorded for a version: its `metrics.*` tags, else its run's metrics."""
    from transfer.errors import TransferError

    try:
        mv = client.get_model_version(model_name, version)
    except Exception:
        raise TransferError(f"model {model_name!r} has no version {version!r} in {client.tracking_uri}") from None
    metrics = {k.removeprefix("metrics."): float(v) for k, v in mv.tags.items() if k.startswith("metrics.")}
    return metrics or (client.get_run(mv.run_id).data.metrics if mv.run_id else {})


def _recorded_metric(client: MlflowClient, version: ModelVersion, metric: str) -> float | None:
    """A version's test metric: its `metrics.<name>` tag, else the metric of the run that logged it."""
    if f"metrics.{metric}" in version.tags:
        return float(version.tags[f"metrics.{metric}"])
    if version.run_id:
        value = client.get_run(version.run_id).data.metrics.get(metric)
        return None if value is None else float(value)
    return None


def _judge(
    client: MlflowClient,
    version: str,
    value: float,
    digest: str | None,
    champion: ModelVersion | None,
    metric: str,
    min_delta: float,
    min_accuracy: float,
    baseline: float | None = None,
    min_delta_over_baseline: float = 0.0,
    chance: float | None = None,
) -> tuple[bool, str]:
    if value < min_accuracy:
        return False, f"{metric} {value:.4f} is below min_accuracy {min_accuracy:.4f}"
    if chance is not None and value <= chance + _EPS:
        return False, f"{metric} {value:.4f} is at chance (always the most frequent class: {chance:.4f})"
    if baseline is not None and value - baseline < min_delta_over_baseline - _EPS:
        return False, (f"{metric} {value:.4f} < the tfidf baseline's {baseline:.4f} of the same run "
                       f"+ min_delta_over_baseline {min_delta_over_baseline:.4f}")
    if champion is None:
        return True, f"no champion yet; {metric} {value:.4f} reaches min_accuracy {min_accuracy:.4f}"
    if str(champion.version) == version:  # ModelVersion.version is an int in MLflow 3.x
        return True, f"version {version} is already the champion"
    champion_digest = champion.tags.get("test_digest")
    if digest is None or champion_digest != digest:
        return False, (
            f"champion v{champion.version} was tested on different data (test_digest "
            f"{(champion_digest or 'unknown')[:12]} vs {(digest or 'unknown')[:12]}); {metric} is not comparable"
        )
    best = _recorded_metric(client, champion, metric)
    if best is None:
        return False, f"champion v{champion.version} has no recorded {metric} to compare against"
    verdict = ">=" if value - best >= min_delta - _EPS else "<"
    return verdict == ">=", (
        f"{metric} {value:.4f} {verdict} champion v{champion.version}'s {best:.4f} + min_delta {min_delta:.4f}"
    )


def promote(
    model_name: str,
    version: str | int,
    candidate_metrics: Mapping[str, float],
    metric: str = "accuracy",
    min_delta: float = 0.0,
    min_accuracy: float = 0.0,
    test_digest: str | None = None,
    client: MlflowClient | None = None,
    baseline_metrics: Mapping[str, float] | None = None,
    min_delta_over_baseline: float = 0.0,
    chance_metrics: Mapping[str, float] | None = None,
    require_above_chance: bool = True,
) -> Decision:
    """Alias `version` challenger, make it champion if it passes the gate, and tag it with the decision.

    test_digest: sha256 of the test data the metrics come from (stored as the `test_digest` version tag;
        None: use the tag already on the version). `min_accuracy` is a floor on `metric`, whatever it is.
    baseline_metrics: the tfidf baseline's test metrics from the same run; the candidate must reach its
        `metric` + `min_delta_over_baseline`. chance_metrics: the most-frequent-class predictor's; the candidate
        must beat it. Both are stored as `baseline.<key>` / `chance.<key>` tags (None: read those tags).
    """
    if metric not in candidate_metrics:
        known = ", ".join(sorted(candidate_metrics)) or "none"
        raise TransferError(f"registry.metric: '{metric}' is not among the candidate's test metrics ({known})")
    client = client or MlflowClient(tracking_uri=tracking_uri())
    version = str(version)
    candidate = client.get_model_version(model_name, version)
    if test_digest is not None:
        client.set_model_version_tag(model_name, version, "test_digest", test_digest)
    digest = test_digest or candidate.tags.get("test_digest")
    for prefix, values in (("metrics", candidate_metrics), ("baseline", baseline_metrics or {}),
                           ("chance", chance_metrics or {})):
        for key, value in values.items():
            client.set_model_version_tag(model_name, version, f"{prefix}.{key}", repr(float(value)))
    client.set_registered_model_alias(model_name, CHALLENGER, version)

    def recorded(prefix: str, given: Mapping[str, float] | None) -> float | None:
        if given is not None:
            return float(given[metric]) if metric in given else None
        tag = client.get_model_version(model_name, version).tags.get(f"{prefix}.{metric}")
        return None if tag is None else float(tag)

    champion = alias_version(client, model_name, CHAMPION)
    promoted, reason = _judge(
        client, version, float(candidate_metrics[metric]), digest, champion, metric, min_delta, min_accuracy,
        recorded("baseline", baseline_metrics), min_delta_over_baseline,
        recorded("chance", chance_metrics) if require_above_chance else None,
    )
    if promoted:
        client.set_registered_model_alias(model_name, CHAMPION, version)
    client.set_model_version_tag(model_name, version, "promotion_decision", "promoted" if promoted else "rejected")
    client.set_model_version_tag(model_name, version, "promotion_reason", reason)
    champion_version = version if promoted else (str(champion.version) if champion else None)
    return Decision(promoted=promoted, reason=reason, champion_version=champion_version)
