"""A general LM built once for a fleet: `transfer lm publish` registers a workspace's tokenizer and general LMs as
one MLflow model version, and `pretrain.from_lm: models:/NAME@ALIAS` fetches it into a workspace that then
skips tokenizing and pretraining.

The model version is data only (`spm.model`, `lm-<direction>.pt` state_dicts, `lm.json`), loaded through this
module (`loader_module`): its pyfunc scores texts by the forward LM's perplexity. `models:/NAME/latest` is the
newest version (MLflow's own; `latest` cannot be an alias); the alias `champion` marks the one with the lowest
held-out perplexity on the same evaluation text (`data.lm_eval` when the workspace had it, else its held-out
tail of the general corpus).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import mlflow
import pandas as pd
import yaml
from mlflow import MlflowClient

from tasks.cache import content_digest
from tasks.pyfunc_model import pip_requirements
from tasks.registry import alias_version
from tasks.tracking import ensure_experiment, git_tags, tracking_uri
from transfer.config import Params
from transfer.errors import TransferError
from transfer.io_utils import file_digest
from transfer.stages import Workspace
from transfer.stages.published import MANIFEST
from transfer.stages.record import searched_folder

__all__ = ["publish", "resolve", "CHAMPION"]

CHAMPION = "champion"


def _score(p: Params, metrics: dict, root: Path) -> tuple[str, float]:
    """(what the perplexity was measured on, the best direction's perplexity there): versions compare on equal text."""
    if p.data.lm_eval and all("lm_eval_ppl" in m for m in metrics.values()):
        digests = "".join(content_digest(searched_folder(root / f)) for f in sorted(p.data.lm_eval))
        on = "lm_eval:" + hashlib.sha256(digests.encode()).hexdigest()[:16]
        return on, min(m["lm_eval_ppl"] for m in metrics.values())
    return "held-out general tail", min(m["valid_ppl"] for m in metrics.values())


def publish(root: Path, p: Params, name: str) -> tuple[str, bool, float]:
    """Register the workspace's general LM as a new version of `name`; -> (version, champion?, its perplexity)."""
    ws = Workspace(root)
    if not ws.metrics("pretrain").is_file():
        raise TransferError(f"{ws.metrics('pretrain')}: missing; `transfer stage pretrain` (or `transfer run`) first")
    metrics = json.loads(ws.metrics("pretrain").read_text())
    directions = [d for d in p.model.directions if ws.art("pretrain", f"lm-{d}.pt").is_file() and d in metrics]
    if not directions:
        raise TransferError(f"{ws.art('pretrain')}: no lm-<direction>.pt for model.directions {p.model.directions}")
    tokenize = json.loads(ws.metrics("tokenize").read_text())
    score_on, score = _score(p, {d: metrics[d] for d in directions}, root)
    corpus = ws.art("tokenize", "general.npy")
    manifest = dict(vocab_size=tokenize["vocab_size"], emb_size=p.model.emb_size, hidden_size=p.model.hidden_size,
                    n_layers=p.model.n_layers, directions=directions, metrics={d: metrics[d] for d in directions},
                    general_tokens=tokenize.get("general_tokens", 0),
                    corpus_digest=file_digest(corpus) if corpus.is_file() else None, score_on=score_on,
                    params={s: p.section(s) for s in ("tokenizer", "model", "pretrain")}, **git_tags(root))
    mlflow.set_tracking_uri(tracking_uri())
    experiment_id = ensure_experiment(p.mlflow.experiment, root / p.mlflow.artifact_location)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "general_lm"
        folder.mkdir()
        shutil.copyfile(ws.art("tokenize", "spm.model"), folder / "spm.model")
        for d in directions:
            shutil.copyfile(ws.art("pretrain", f"lm-{d}.pt"), folder / f"lm-{d}.pt")
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
        with mlflow.start_run(run_name=f"publish-{name}", experiment_id=experiment_id,
                              tags={"stage": "publish", "score_on": score_on}):
            mlflow.log_metrics({f"{d}.valid_ppl": metrics[d]["valid_ppl"] for d in directions} | {"score": score})
            info = mlflow.pyfunc.log_model(name="general_lm", loader_module=__name__, data_path=str(folder),
                                           registered_model_name=name, pip_requirements=pip_requirements())
    client = MlflowClient(tracking_uri=tracking_uri())
    version = str(info.registered_model_version)
    for key, value in (("score", score), ("score_on", score_on)):
        client.set_model_version_tag(name, version, key, str(value))
    current = alias_version(client, name, CHAMPION)
    better = current is None or current.tags.get("score_on") != score_on or score < float(current.tags["score"])
    if better:  # an LM judged on other text cannot be compared: the newest one takes over
        client.set_registered_model_alias(name, CHAMPION, version)
    return version, better, score


def resolve(p: Params, root: Path) -> tuple[Params, str | None]:
    """`p` with `pretrain.from_lm` fetched into `artifacts/published/` when it is a models:/ or runs:/ URI;
    -> (params, the model version it resolved to, or None)."""
    uri = p.pretrain.from_lm
    if not uri or not uri.startswith(("models:/", "runs:/")):
        return p, None
    mlflow.set_tracking_uri(tracking_uri())
    try:
        version = _version_of(uri)
        name = uri.split(":/", 1)[1].split("@")[0].split("/")[0]
        # one folder per version: an alias that moves never mixes two versions' files
        dest = root / "artifacts" / "published" / f"{name}-{version}"
        local = dest if (dest / "MLmodel").is_file() else _download(uri, dest)
    except Exception as e:
        raise TransferError(f"pretrain.from_lm: {uri!r} could not be fetched: {str(e).splitlines()[0]}") from None
    data = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]["data"]
    pretrain = dataclasses.replace(p.pretrain, from_lm=str(local / data))
    return dataclasses.replace(p, pretrain=pretrain), version


def _download(uri: str, dest: Path) -> Path:
    """The model's files into `dest`, whole or not at all (a temp folder renamed into place)."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp)))
        (local if local != tmp else tmp).rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _version_of(uri: str) -> str:
    """The registered version a models:/ URI names (NAME@ALIAS, NAME/latest, NAME/N), or the run id of runs:/."""
    if uri.startswith("runs:/"):
        return uri.removeprefix("runs:/").split("/")[0]
    client = MlflowClient(tracking_uri=tracking_uri())
    ref = uri.removeprefix("models:/")
    if "@" in ref:
        name, alias = ref.split("@", 1)
        return str(client.get_model_version_by_alias(name, alias).version)
    name, _, version = ref.partition("/")
    if version == "latest":
        return str(max(int(v.version) for v in client.search_model_versions(f"name='{name}'")))
    return version


class GeneralLM:
    """The published LM as a pyfunc: each text's perplexity under the forward (else the first) direction."""

    def __init__(self, folder: Path):
        import torch

        from transfer.model import LanguageModel, lm_config
        from transfer.tokenizer import Tokenizer

        self.manifest = json.loads((folder / MANIFEST).read_text())
        m = self.manifest
        self.direction = "fwd" if "fwd" in m["directions"] else m["directions"][0]
        self.model = LanguageModel(lm_config(m["vocab_size"], 0.0, emb_size=m["emb_size"], hidden_size=m["hidden_size"],
                                             n_layers=m["n_layers"]))
        self.model.load_state_dict(torch.load(folder / f"lm-{self.direction}.pt", weights_only=True))
        self.model.eval()
        self.tok = Tokenizer.load(folder / "spm.model")

    def predict(self, model_input, params: dict | None = None) -> pd.DataFrame:
        import torch

        from tasks.pyfunc_model import texts_of
        from transfer.tokenizer import BOS_ID

        out = []
        for ids in self.tok.encode(texts_of(model_input)):
            seq = [BOS_ID, *ids]
            x = torch.tensor([seq[::-1] if self.direction == "bwd" else seq])
            if x.shape[1] < 2:  # nothing to predict
                out.append(float("nan"))
                continue
            with torch.no_grad():
                self.model.reset()
                logits = self.model(x[:, :-1])[0]
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
            out.append(float(torch.exp(nll)))
        return pd.DataFrame({"perplexity": out})


def _load_pyfunc(data_path: str) -> GeneralLM:
    return GeneralLM(Path(data_path))
