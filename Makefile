# One command from a fresh clone: `make test` (tests + lint), `make demo` (the main job).
# The virtual environment is created once and refreshed when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of PyTorch, pinned so CI never pulls a multi-GB CUDA wheel.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv test test-slow test-deepspeed lint format demo bench clean

venv: $(VENV)/.stamp

$(VENV)/.stamp: pyproject.toml setup.py native_src/build.py native_src/fzero_kernels.c native_src/fzero_common.h native_src/fzero_aio.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e '.[dev,examples]'
	touch $@

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q -m "not slow and not deepspeed_reference"

test-slow: venv
	$(BIN)/python -m pytest -q -m "slow and not deepspeed_reference"

# fzero against DeepSpeed itself: a separate environment with DeepSpeed (CPU accelerator,
# gloo; its Adam op builds on first use), the same scripts run under both
DS_VENV ?= .venv-deepspeed
DEEPSPEED_PIN ?= deepspeed==0.19.8

$(DS_VENV)/.stamp: Makefile
	test -x $(DS_VENV)/bin/python || $(PYTHON) -m venv $(DS_VENV)
	$(DS_VENV)/bin/python -m pip install -q $(TORCH_PIN)
	$(DS_VENV)/bin/python -m pip install -q $(DEEPSPEED_PIN) accelerate transformers lightning safetensors tensorboard wandb
	touch $@

test-deepspeed: venv $(DS_VENV)/.stamp
	FZERO_DEEPSPEED_PYTHON=$(DS_VENV)/bin/python $(BIN)/python -m pytest -q -m deepspeed_reference tests/deepspeed_reference

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

demo: venv
	$(BIN)/fzero run -n 2 examples/train_transformer.py --steps 100

# The quick benchmarks (a few minutes): each table, medians and min-max over interleaved
# rounds, appended to one file that benchmarks/plot.py draws.
BENCH_RESULTS ?= benchmarks/results.md

bench: venv
	echo "# make bench, $$(date -u +%Y-%m-%d), $$(nproc) cores" > $(BENCH_RESULTS)
	echo >> $(BENCH_RESULTS)
	$(BIN)/python benchmarks/step_time.py --nproc 2 --steps 5 --rounds 3 --results $(BENCH_RESULTS)
	$(BIN)/python benchmarks/cpu_adam.py --numel 10000000 --rounds 10 --results $(BENCH_RESULTS)
	$(BIN)/python benchmarks/plot.py results $(BENCH_RESULTS) -o $(BENCH_RESULTS:.md=.png)

clean:
	rm -rf $(VENV) $(DS_VENV) build *.egg-info .pytest_cache .ruff_cache
