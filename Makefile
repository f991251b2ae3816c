# One command from a fresh clone: `make test` (tests + lint), `make demo` (the main job),
# `make docs` (the documentation site, into site/).
# The virtual environment is created once and refreshed when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of PyTorch, pinned so CI never pulls a multi-GB CUDA wheel.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv test test-slow test-deepspeed durations coverage lint format demo bench docs clean

venv: $(VENV)/.stamp

$(VENV)/.stamp: pyproject.toml setup.py native_src/build.py native_src/fzero_kernels.c native_src/fzero_common.h native_src/fzero_aio.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e '.[dev,examples,docs]'
	touch $@

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The fast cases in two pytest processes (pytest-xdist; each has its own persistent rank
# groups): on two cores, one process's ranks run while the other's wait on gloo, a
# launched script or a timeout. `pytest path::name` alone runs in one process as before.
PYTEST_PROCS ?= -n 2 --dist worksteal

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_PROCS) -m "not slow and not deepspeed_reference"

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

# Each test's seconds and the kinds of process it used (tests/conftest.py), for the three
# jobs, into tests/DURATIONS.md. DURATIONS_BEFORE=dir (an earlier run's fast.json,
# slow.json, deepspeed.json): its tables beside the new ones.
DURATIONS_DIR ?= .durations
JOBS_JSON = fast=$(1)/fast.json slow=$(1)/slow.json deepspeed=$(1)/deepspeed.json

durations: venv $(DS_VENV)/.stamp
	mkdir -p $(DURATIONS_DIR)
	FZERO_TEST_DURATIONS=$(DURATIONS_DIR)/fast.json \
		$(BIN)/python -m pytest -q $(PYTEST_PROCS) -m "not slow and not deepspeed_reference"
	FZERO_TEST_DURATIONS=$(DURATIONS_DIR)/slow.json \
		$(BIN)/python -m pytest -q -m "slow and not deepspeed_reference"
	FZERO_TEST_DURATIONS=$(DURATIONS_DIR)/deepspeed.json FZERO_DEEPSPEED_PYTHON=$(DS_VENV)/bin/python \
		$(BIN)/python -m pytest -q -m deepspeed_reference tests/deepspeed_reference
	$(BIN)/python -m tests.durations tests/DURATIONS.md --after $(call JOBS_JSON,$(DURATIONS_DIR)) \
		$(if $(DURATIONS_BEFORE),--before $(call JOBS_JSON,$(DURATIONS_BEFORE)))

# Line and branch coverage of fzero/ over the three jobs, the rank processes and launched
# scripts included (pyproject's [tool.coverage.run]).
coverage: venv $(DS_VENV)/.stamp
	rm -f .coverage .coverage.*
	$(BIN)/python -m pytest -q $(PYTEST_PROCS) -m "not deepspeed_reference" --cov --cov-report=
	FZERO_DEEPSPEED_PYTHON=$(DS_VENV)/bin/python $(BIN)/python -m pytest -q \
		-m deepspeed_reference tests/deepspeed_reference --cov --cov-append --cov-report=
	$(BIN)/coverage combine --append -q
	$(BIN)/coverage report

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

# The documentation site: MkDocs with --strict (a broken link, anchor or API reference
# fails), the API reference and the configuration keys generated from the code.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(DS_VENV) build site *.egg-info .pytest_cache .ruff_cache
