# Two commands do all the set-up on a fresh machine:  `make run`  and  `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test clean

setup: $(STAMP)

# torch first and pinned: an open range would pull a multi-GB CUDA build; the CPU wheel 2.13.0 is local here.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

run: setup  ## the whole pipeline on the embedded demo: SQLite MLflow, Prefect's local server, DVC-ready outputs
	$(BIN)/transfer run

test: setup  ## the test suite (real Prefect, MLflow, DVC, SentencePiece and torch on tiny configs)
	$(BIN)/python -m pytest -q

clean:
	rm -rf artifacts metrics plots mlflow.db mlartifacts .prefect-results data/demo dvc_plots
