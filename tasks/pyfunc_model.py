"""The classifier as an MLflow pyfunc model that takes raw text (a `text` column or a list of strings).

Logged as "models from code": MLflow stores this file and runs it on load, so nothing is unpickled; the
weights are plain state_dicts loaded with `torch.load(weights_only=True)` by `transfer.evaluate.Predictor`.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

MAX_CHARS = 20_000  # longer texts keep their end: the classifier pools only the last max_len (1,440) tokens


def _texts(model_input) -> list[str]:
    def bad(msg: str) -> MlflowException:
        return MlflowException(msg, error_code=INVALID_PARAMETER_VALUE)  # served as HTTP 400

    if isinstance(model_input, pd.DataFrame):
        if "text" not in model_input.columns:
            raise bad(f"input needs a 'text' column; got columns {list(model_input.columns)}")
        values = list(model_input["text"])
    elif isinstance(model_input, (list, tuple)):
        values = list(model_input)
    elif isinstance(model_input, str):
        values = [model_input]
    else:
        raise bad(f"input must be a DataFrame with a 'text' column or a list of strings, not {type(model_input).__name__}")
    if not values:
        raise bad("input holds no texts")
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise bad(f"text {i} is {type(v).__name__}, not a string")
    return [v[-MAX_CHARS:] for v in values]


class TransferClassifier(mlflow.pyfunc.PythonModel):
    """Returns one row per text: `label`, `probability` (of that label) and `prob_<class>` per class."""

    def load_context(self, context) -> None:
        from transfer.evaluate import Predictor

        self.predictor = Predictor.from_dir(Path(context.artifacts["bundle"]))

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        proba = self.predictor.predict_proba(_texts(model_input))
        classes = self.predictor.classes
        out = pd.DataFrame(proba, columns=[f"prob_{c}" for c in classes])
        out.insert(0, "probability", proba.max(axis=1))
        out.insert(0, "label", [classes[i] for i in proba.argmax(axis=1)])
        return out


mlflow.models.set_model(TransferClassifier())
