"""The classifier as an MLflow pyfunc model that takes raw text (a `text` column or a list of strings).

Logged with MLflow's `loader_module` flavour: the model artifact is data only (the bundle's weights, `spm.model`,
`meta.json`, and MLflow's MLmodel with the signature). Loading imports this module from the installed package
and reads the weights with `torch.load(weights_only=True)` (`transfer.evaluate.Predictor`), so whoever can
write the artifact store cannot make a server or `transfer predict` run code.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

MAX_CHARS = 20_000  # longer texts keep their end: the classifier pools only the last max_len (1,440) tokens
LOADER_MODULE = __name__


def pip_requirements() -> list[str]:
    """What a model's environment needs, pinned to this one's versions."""
    from importlib.metadata import version

    return [f"{pkg}=={version(pkg)}" for pkg in ("torch", "sentencepiece", "numpy", "pandas", "mlflow")]


def bad_input(msg: str) -> MlflowException:
    return MlflowException(msg, error_code=INVALID_PARAMETER_VALUE)  # served as HTTP 400


def texts_of(model_input) -> list[str]:
    """The texts of a DataFrame with a `text` column, a list of strings or one string; anything else is refused."""
    if isinstance(model_input, pd.DataFrame):
        if "text" not in model_input.columns:
            raise bad_input(f"input needs a 'text' column; got columns {list(model_input.columns)}")
        values = list(model_input["text"])
    elif isinstance(model_input, (list, tuple)):
        values = list(model_input)
    elif isinstance(model_input, str):
        values = [model_input]
    else:
        raise bad_input(f"input must be a DataFrame with a 'text' column or a list of strings, "
                        f"not {type(model_input).__name__}")
    if not values:
        raise bad_input("input holds no texts")
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise bad_input(f"text {i} is {type(v).__name__}, not a string")
    return [v[-MAX_CHARS:] for v in values]


class TextClassifierModel:
    """Returns one row per text: `label`, `probability` (of that label) and `prob_<class>` per class."""

    def __init__(self, bundle: Path):
        from transfer.evaluate import Predictor

        self.predictor = Predictor.from_dir(bundle)

    def predict(self, model_input, params: dict | None = None) -> pd.DataFrame:
        proba = self.predictor.predict_proba(texts_of(model_input))
        classes = self.predictor.classes
        out = pd.DataFrame(proba, columns=[f"prob_{c}" for c in classes])
        out.insert(0, "probability", proba.max(axis=1))
        out.insert(0, "label", [classes[i] for i in proba.argmax(axis=1)])
        return out


def _load_pyfunc(data_path: str) -> TextClassifierModel:
    """MLflow's entry point: `data_path` is the bundle folder stored with the model."""
    return TextClassifierModel(Path(data_path))


def load_model(model: str):
    """(model with .predict(DataFrame) -> DataFrame, classes) from a bundle folder or an MLflow model URI; a model
    that cannot be loaded is one TransferError naming it."""
    from transfer.errors import TransferError

    if Path(model).is_dir() and (Path(model) / "meta.json").is_file():
        try:
            loaded = TextClassifierModel(Path(model))
        except TransferError:
            raise
        except Exception as e:  # a hand-edited or foreign meta.json: JSONDecodeError, KeyError, TypeError ...
            raise TransferError(f"{model}: not a loadable classifier bundle "
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
        return loaded, loaded.predictor.classes
    try:
        pyfunc = mlflow.pyfunc.load_model(model)
    except Exception as e:
        raise TransferError(f"model {model!r} could not be loaded: {str(e).splitlines()[0]}") from None
    schema = pyfunc.metadata.get_output_schema()  # label, probability, prob_<class> for each class
    classes = [n.removeprefix("prob_") for n in (schema.input_names() if schema else []) if n.startswith("prob_")]
    return pyfunc, classes
