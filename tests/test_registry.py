"""The promotion gate against a real SQLite model registry, with versions of a trivial pyfunc model."""

import mlflow
import mlflow.pyfunc
import pytest
from mlflow.tracking import MlflowClient

from tasks.registry import CHALLENGER, CHAMPION, promote
from tasks.tracking import ensure_experiment, tracking_uri
from tests.test_tracking import migrated_sqlite_uri
from transfer.errors import TransferError

TEST_SET = "a" * 64  # sha256 of the test data the metrics come from
OTHER_TEST_SET = "b" * 64

# MLflow's own SQLAlchemy usage, not ours
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")


class MajorityClass(mlflow.pyfunc.PythonModel):
    """Predicts label 0 for every text: enough to have something to register."""

    def predict(self, model_input: list[str], params=None) -> list[int]:
        return [0] * len(model_input)


@pytest.fixture(scope="module")
def model_uri(tmp_path_factory, pytestconfig):
    """One SQLite registry for the module and one logged model; tests register versions under their own names."""
    root = tmp_path_factory.mktemp("registry")
    previous = mlflow.get_tracking_uri()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", migrated_sqlite_uri(pytestconfig, root / "mlflow.db"))
        mlflow.set_tracking_uri(tracking_uri())
        with mlflow.start_run(experiment_id=ensure_experiment("registry", root / "artifacts")):
            info = mlflow.pyfunc.log_model(name="model", python_model=MajorityClass(), pip_requirements=[])
        yield info.model_uri
    mlflow.set_tracking_uri(previous)


@pytest.fixture
def register(model_uri, request):
    """register() -> the next version number of a model named after the test."""
    name = request.node.name
    return lambda: str(mlflow.register_model(model_uri, name).version)


def champions(name: str) -> list[str]:
    """Every version that carries the champion alias."""
    client = MlflowClient(tracking_uri())
    versions = client.search_model_versions(f"name='{name}'")
    return [str(v.version) for v in versions if CHAMPION in client.get_model_version(name, v.version).aliases]


def tags(name: str, version: str) -> dict[str, str]:
    return MlflowClient(tracking_uri()).get_model_version(name, version).tags


def test_first_version_becomes_champion(register, request):
    v1 = register()
    decision = promote(request.node.name, v1, {"accuracy": 0.8}, test_digest=TEST_SET)
    assert decision.promoted and decision.champion_version == v1
    assert "no champion yet" in decision.reason
    assert tags(request.node.name, v1)["promotion_decision"] == "promoted"
    assert tags(request.node.name, v1)["promotion_reason"] == decision.reason
    assert tags(request.node.name, v1)["test_digest"] == TEST_SET


def test_worse_version_stays_challenger(register, request):
    name = request.node.name
    v1, v2 = register(), register()
    promote(name, v1, {"accuracy": 0.8}, test_digest=TEST_SET)
    decision = promote(name, v2, {"accuracy": 0.7}, test_digest=TEST_SET)
    assert not decision.promoted and decision.champion_version == v1
    assert "0.7000 < champion v1's 0.8000" in decision.reason
    client = MlflowClient(tracking_uri())
    assert str(client.get_model_version_by_alias(name, CHALLENGER).version) == v2
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == v1
    assert tags(name, v2)["promotion_decision"] == "rejected"


def test_better_by_min_delta_becomes_the_one_champion(register, request):
    name = request.node.name
    v1, v2, v3 = register(), register(), register()
    promote(name, v1, {"accuracy": 0.80}, min_delta=0.05, test_digest=TEST_SET)
    assert not promote(name, v2, {"accuracy": 0.84}, min_delta=0.05, test_digest=TEST_SET).promoted
    decision = promote(name, v3, {"accuracy": 0.85}, min_delta=0.05, test_digest=TEST_SET)
    assert decision.promoted and decision.champion_version == v3
    assert champions(name) == [v3]


def test_below_min_accuracy_is_refused_even_without_a_champion(register, request):
    v1 = register()
    decision = promote(request.node.name, v1, {"accuracy": 0.2}, min_accuracy=0.5, test_digest=TEST_SET)
    assert not decision.promoted and decision.champion_version is None
    assert "below min_accuracy 0.5000" in decision.reason
    assert champions(request.node.name) == []


def test_metrics_from_different_test_data_are_not_compared(register, request):
    name = request.node.name
    v1, v2 = register(), register()
    promote(name, v1, {"accuracy": 0.6}, test_digest=TEST_SET)
    decision = promote(name, v2, {"accuracy": 0.99}, test_digest=OTHER_TEST_SET)
    assert not decision.promoted and decision.champion_version == v1
    assert "different data" in decision.reason and "not comparable" in decision.reason
    assert champions(name) == [v1]


def test_a_metric_the_candidate_lacks_is_a_user_error(register, request):
    with pytest.raises(TransferError, match="'f1' is not among"):
        promote(request.node.name, register(), {"accuracy": 0.9}, metric="f1")


def test_a_candidate_below_the_tfidf_baseline_or_at_chance_is_refused_and_says_why(register, request):
    name = request.node.name
    v1, v2, v3 = register(), register(), register()
    below = promote(name, v1, {"accuracy": 0.30}, test_digest=TEST_SET, baseline_metrics={"accuracy": 0.82},
                    chance_metrics={"accuracy": 0.25})
    assert not below.promoted and below.champion_version is None
    assert "< the tfidf baseline's 0.8200" in below.reason
    client = MlflowClient(tracking_uri())
    tags = client.get_model_version(name, v1).tags
    assert tags["promotion_decision"] == "rejected" and "tfidf baseline" in tags["promotion_reason"]
    assert float(tags["baseline.accuracy"]) == 0.82 and float(tags["chance.accuracy"]) == 0.25

    at_chance = promote(name, v2, {"accuracy": 0.25}, test_digest=TEST_SET, chance_metrics={"accuracy": 0.25})
    assert not at_chance.promoted and "at chance" in at_chance.reason

    # above both, and by the margin asked for: champion; the same check re-run by hand reads the tags
    ok = promote(name, v3, {"accuracy": 0.86}, test_digest=TEST_SET, baseline_metrics={"accuracy": 0.82},
                 min_delta_over_baseline=0.03, chance_metrics={"accuracy": 0.25})
    assert ok.promoted and champions(name) == [v3]
    again = promote(name, v1, {"accuracy": 0.30}, test_digest=TEST_SET)  # `transfer promote 1`: tags only
    assert not again.promoted and "tfidf baseline" in again.reason
