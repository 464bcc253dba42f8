# Two commands do all the set-up on a fresh machine with only Python 3.11+:
#   make demo   -> creates .venv, installs distrain, runs the quickstart (offline)
#   make test   -> creates .venv with the dev extra, runs the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/distrain train --config configs/quickstart.yaml

test: $(BIN)/.installed
	$(BIN)/ruff check distrain tests examples benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) runs checkpoints
