"""transfer.config: params.yaml is strict, typed and validated; errors name the file and the key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from transfer.config import (
    ClassifierParams,
    DataParams,
    Params,
    TrainParams,
    dump_params,
    flatten,
    load_params,
)
from transfer.errors import TransferError

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def test_repo_params_yaml_loads_and_sets_every_section_and_key():
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    assert raw == load_params(REPO / "params.yaml").to_dict()  # every key spelled out, none left to defaults


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_params_files_load_strictly_and_point_at_the_shared_data(path):
    params = load_params(path)  # unknown keys, or a variant whose direction is not trained, fail here
    assert params.data.train.startswith("../shared/data/") and params.data.test.startswith("../shared/data/")


def test_repo_params_yaml_is_the_tiny_demo_config():
    params = load_params(REPO / "params.yaml")
    assert params.data.general == ["data/demo/general.txt"]
    assert (params.data.train, params.data.test) == ("data/demo/train.csv", "data/demo/test.csv")
    assert params.tokenizer.vocab_size <= 1000 and params.model.hidden_size <= 256
    assert params.model.n_layers == 3


def test_dataclass_defaults_are_the_real_data_values():
    p = Params()
    assert (p.tokenizer.vocab_size, p.model.emb_size, p.model.hidden_size) == (15000, 400, 1152)
    assert (p.pretrain.epochs, p.pretrain.lr, p.pretrain.valid_frac) == (1, 2e-3, 0.02)
    assert (p.finetune_lm.epochs, p.finetune_lm.freeze_epochs) == (2, 1)
    assert (p.classifier.lr, p.classifier.drop_mult, p.classifier.max_len) == (1e-2, 0.5, 1440)
    assert p.classifier.unfreeze_epochs == [1, 1, 1, 2] and p.classifier.epochs == 5
    assert p.evaluate.variants == ["tfidf", "ulmfit_fwd", "ulmfit_bwd", "ulmfit_ensemble", "ulmfit+tfidf"]


def test_missing_sections_and_keys_take_the_defaults(tmp_path):
    params = load_params(_write(tmp_path, "classifier:\n  lr: 0.02\n"))
    assert params == dataclasses.replace(Params(), classifier=ClassifierParams(lr=0.02))
    assert load_params(_write(tmp_path, "")) == Params()


def test_params_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Params().classifier.lr = 1.0  # type: ignore[misc]


def test_dump_then_load_round_trips(tmp_path):
    params = load_params(REPO / "params.yaml", ["classifier.lr=3e-4", "data.valid=v.csv"])
    path = dump_params(params, tmp_path / "out" / "params.yaml")
    assert load_params(path) == params
    assert [p.name for p in path.parent.iterdir()] == ["params.yaml"]


def test_unknown_key_names_the_path_and_suggests_the_closest(tmp_path):
    path = _write(tmp_path, "classifier:\n  lrr: 0.01\n")
    with pytest.raises(TransferError) as e:
        load_params(path)
    assert str(e.value) == f"{path}: unknown key 'classifier.lrr' (did you mean 'lr'?)"


def test_unknown_section_suggests_the_closest(tmp_path):
    with pytest.raises(TransferError, match=r"unknown section 'clasifier' \(did you mean 'classifier'\?\)"):
        load_params(_write(tmp_path, "clasifier:\n  lr: 0.01\n"))


def test_classifier_epochs_is_unknown_and_points_at_unfreeze_epochs():
    with pytest.raises(TransferError, match="set unfreeze_epochs"):
        load_params(REPO / "params.yaml", ["classifier.epochs=3"])


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("classifier:\n  lr: fast\n", "classifier.lr must be a number, got 'fast' (str)"),
        ("classifier:\n  bs: 3.5\n", "classifier.bs must be an integer, got 3.5 (float)"),
        ("classifier:\n  bs: true\n", "classifier.bs must be an integer, got True (bool)"),
        ("data:\n  header: 1\n", "data.header must be a boolean (true/false), got 1 (int)"),
        ("data:\n  label_col: 3.5\n", "data.label_col must be a string, got 3.5 (float)"),
        ("classifier:\n  unfreeze_epochs: [1, two]\n", "classifier.unfreeze_epochs[1] must be an integer, got 'two'"),
        ("model:\n  directions: {fwd: 1}\n", "model.directions must be a list of str"),
        ("classifier: 3\n", "section 'classifier' must be a mapping"),
        ("- a\n- b\n", "must be a mapping of sections"),
    ],
)
def test_wrong_types_name_the_key_the_type_and_the_value(tmp_path, yaml_text, message):
    path = _write(tmp_path, yaml_text)
    with pytest.raises(TransferError, match=f"^{re.escape(str(path))}: .*{re.escape(message)}"):
        load_params(path)


def test_numbers_are_read_the_way_people_write_them(tmp_path):
    params = load_params(_write(tmp_path, (
        "classifier:\n  lr: 1e-3\n  wd: 0\n  ratio: 32\n"  # PyYAML reads 1e-3 as the string '1e-3'
        "pretrain:\n  max_tokens: 2e6\n"  # an integral float is an integer
        "tokenizer:\n  max_sentences: 1_000_000\n"
    )))
    assert params.classifier.lr == 1e-3 and isinstance(params.classifier.lr, float)
    assert params.classifier.wd == 0.0 and isinstance(params.classifier.wd, float)
    assert params.pretrain.max_tokens == 2_000_000 and isinstance(params.pretrain.max_tokens, int)
    assert params.tokenizer.max_sentences == 1_000_000


def test_a_single_string_is_accepted_for_a_list_of_strings(tmp_path):
    params = load_params(_write(tmp_path, "data:\n  general: corpus/\n"), ["model.directions=fwd",
                                                                           "evaluate.variants=ulmfit_fwd"])
    assert params.data.general == ["corpus/"] and params.model.directions == ["fwd"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("classifier.lr=0", "classifier.lr must be > 0, got 0.0"),
        ("classifier.lr=-1e-3", "classifier.lr must be > 0"),
        ("pretrain.drop_mult=1.5", "pretrain.drop_mult must be in [0, 1], got 1.5"),
        ("tokenizer.vocab_size=7", "tokenizer.vocab_size must be >= 8, got 7"),
        ("finetune_lm.bs=0", "finetune_lm.bs must be >= 1, got 0"),
        ("data.valid_frac=1", "data.valid_frac must be in (0, 1)"),
        ("data.test_frac=0", "data.test_frac must be in (0, 1)"),
        ("pretrain.valid_frac=1.0", "pretrain.valid_frac must be in (0, 1)"),
        ("data.valid_frac=0.85", "data.valid_frac plus test_frac must be < 1"),
        ("model.directions=[]", "model.directions must be a non-empty subset"),
        ("model.directions=[fwd, up]", "model.directions must be a non-empty subset"),
        ("model.directions=[fwd, fwd]", "model.directions has a repeated entry"),
        ("evaluate.variants=[tfidf, bert]", "evaluate.variants must be one of"),
        ("evaluate.variants=[]", "evaluate.variants must name at least one variant"),
        ("tokenizer.model_type=word", "tokenizer.model_type must be one of ['unigram', 'bpe'], got 'word'"),
        ("classifier.precision=fp16", "classifier.precision must be one of ['auto', 'fp32', 'bf16']"),
        ("pretrain.schedule=cosine", "pretrain.schedule must be one of ['stlr', 'one_cycle']"),
        ("data.max_train_labels=0", "data.max_train_labels must be >= 1, got 0"),
        ("data.general_doc_per=paragraph", "data.general_doc_per must be one of ['line', 'file']"),
        ("data.encoding=utf-9", "data.encoding is not a known text encoding"),
        ("classifier.betas=[0.9]", "classifier.betas must be two numbers in [0, 1)"),
        ("classifier.clip=0", "classifier.clip must be > 0 or null"),
        ("classifier.unfreeze_epochs=[0, 0]", "classifier.unfreeze_epochs must train for at least one epoch"),
        ("classifier.unfreeze_lr_mult=[1, 0.5]", "classifier.unfreeze_lr_mult must have one multiplier per"),
        ("classifier.unfreeze_lr_mult=[1, 1, 0, 1]", "classifier.unfreeze_lr_mult must be positive"),
        ("classifier.self_train_teacher=oracle", "classifier.self_train_teacher must be 'classifier' or 'probe'"),
        ("classifier.probe_c=0", "classifier.probe_c must be > 0"),
        ("classifier.bs=1", "classifier.bs must be >= 2 (BatchNorm needs two rows), got 1"),
        ("classifier.min_bs=1", "classifier.min_bs must be >= 2 (BatchNorm needs two rows)"),
        ("schedule.cron=nightly", "schedule.cron must have five fields"),
        ("registry.min_accuracy=1.5", "registry.min_accuracy must be in [0, 1]"),
    ],
)
def test_out_of_range_values_fail_naming_the_override_and_key(override, message):
    with pytest.raises(TransferError) as e:
        load_params(REPO / "params.yaml", [override])
    assert str(e.value).startswith(f"override '{override}': ")
    assert message in str(e.value)


@pytest.mark.parametrize("value", ["null", "~", "1", "2e6"])
def test_max_train_labels_may_be_null_or_positive(value):
    load_params(REPO / "params.yaml", [f"data.max_train_labels={value}"])


def test_out_of_range_value_in_the_file_names_the_file(tmp_path):
    path = _write(tmp_path, "classifier:\n  drop_mult: 2\n")
    with pytest.raises(TransferError, match=f"^{re.escape(str(path))}: classifier.drop_mult must be in"):
        load_params(path)


def test_variants_need_the_directions_they_use():
    with pytest.raises(TransferError, match="evaluate.variants includes 'ulmfit_bwd' but model.directions is"):
        load_params(REPO / "params.yaml", ["model.directions=[fwd]"])
    params = load_params(REPO / "params.yaml", ["model.directions=[fwd]", "evaluate.variants=[tfidf, ulmfit_fwd]"])
    assert params.model.directions == ["fwd"]


def test_overrides_are_parsed_as_yaml_like_dvc_exp_run_set_param():
    params = load_params(REPO / "params.yaml", [
        "classifier.lr=1e-3", "classifier.unfreeze_epochs=[2, 2]", "data.valid=null",
        "data.header=false", "pretrain.max_tokens=5000", "data.test=other.csv",
    ])
    assert params.classifier.lr == 1e-3 and params.classifier.unfreeze_epochs == [2, 2]
    assert params.data.valid is None and params.data.header is False
    assert params.pretrain.max_tokens == 5000 and params.data.test == "other.csv"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("classifier.lr", "expected section.key=value"),
        ("lr=0.1", "expected section.key=value"),
        ("a.b.c=1", "expected section.key=value"),
        ("classifier.=1", "expected section.key=value"),
        ("classifier.lrr=1", "unknown key 'classifier.lrr' (did you mean 'lr'?)"),
        ("clasifier.lr=1", "unknown section 'clasifier' (did you mean 'classifier'?)"),
        ("classifier.lr=[1", "value is not valid YAML"),
        ("classifier.lr=abc", "classifier.lr must be a number, got 'abc' (str)"),
    ],
)
def test_bad_overrides_fail_naming_the_override(override, message):
    with pytest.raises(TransferError) as e:
        load_params(REPO / "params.yaml", [override])
    assert str(e.value).startswith(f"override '{override}': ")
    assert message in str(e.value)


def test_missing_file_and_broken_yaml_name_the_file_and_line(tmp_path):
    with pytest.raises(TransferError, match="nope.yaml: file not found"):
        load_params(tmp_path / "nope.yaml")
    with pytest.raises(TransferError, match=r"params.yaml, line 3: not valid YAML"):
        load_params(_write(tmp_path, "data:\n  seed: 1\n  train: a: b\n"))


def test_section_returns_a_plain_dict_and_rejects_unknown_names():
    params = Params()
    assert params.section("classifier")["unfreeze_epochs"] == [1, 1, 1, 2]
    assert "epochs" not in params.section("classifier")
    with pytest.raises(TransferError, match="did you mean 'classifier'"):
        params.section("clasifier")


def test_flatten_gives_dotted_scalar_keys_for_logging():
    flat = flatten(Params().to_dict())
    assert flat["classifier.lr"] == 1e-2
    assert flat["model.directions"] == '["fwd", "bwd"]'
    assert flat["data.valid"] is None
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in flat.values())
    assert len(flat) == sum(len(s) for s in Params().to_dict().values())


def test_direct_construction_validates_too():
    with pytest.raises(TransferError, match="lr must be > 0"):
        TrainParams(lr=0)
    with pytest.raises(TransferError, match="test_frac must be in"):
        DataParams(test_frac=1.0)


def test_columns_named_by_index_are_read_as_strings(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("data:\n  header: false\n  label_col: 0\n  text_cols: [1, 2]\n")
    p = load_params(path)
    assert p.data.label_col == "0" and p.data.text_cols == ["1", "2"]


@pytest.mark.parametrize("override, ok", [
    ("mlflow.artifact_location=/tmp/elsewhere", False), ("mlflow.artifact_location=../outside", False),
    ("mlflow.artifact_location=s3://bucket/transfer", True), ("mlflow.artifact_location=runs/artifacts", True),
    ("registry.model_name=../../x", False), ("registry.model_name=team.clf-v2", True),
])
def test_names_and_locations_from_params_stay_inside_the_workspace(override, ok):
    if ok:
        load_params(REPO / "params.yaml", [override])
        return
    key = override.split("=")[0]
    with pytest.raises(TransferError, match=rf"override '{re.escape(override)}': {re.escape(key)} must be"):
        load_params(REPO / "params.yaml", [override])
