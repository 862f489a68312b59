# Two entry points: `make serve` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test serve bench clean

setup: $(STAMP)

# torch==2.13.0 first: on these machines it is a CPU wheel already on disk; a bare
# "torch" requirement would otherwise pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest tests

serve: $(STAMP)
	$(BIN)/unmask serve

bench: $(STAMP)
	$(BIN)/python bench/decode.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
