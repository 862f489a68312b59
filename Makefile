# Two entry points: `make serve` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test serve bench model clean

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

# Rebuild the built-in model from scratch on this machine (about 2 h on 2 CPU cores; see docs/model-card.md).
model: $(STAMP)
	$(BIN)/unmask corpus
	$(BIN)/unmask train --out runs/pretrain --steps 570 --warmup 60 --lr 1.5e-3 --eval-every 100 --save-every 50
	$(BIN)/unmask finetune --model runs/pretrain/model --data data/sft/train.jsonl --eval-data data/sft/heldout.jsonl \
		--out runs/sft --steps 330 --warmup 20 --lr 5e-4 --pack --eval-every 100 --save-every 50
	rm -rf src/unmask/assets/unmask-tiny && cp -r runs/sft/model src/unmask/assets/unmask-tiny

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
