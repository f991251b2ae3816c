# One command from a fresh clone: `make test` (tests + lint), `make demo` (the main job).
# The virtual environment is created once and refreshed when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of PyTorch, pinned so CI never pulls a multi-GB CUDA wheel.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv test test-slow lint format demo clean

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
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: venv
	$(BIN)/python -m pytest -q -m slow

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

demo: venv
	$(BIN)/fzero run -n 2 examples/train_transformer.py --steps 100

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
