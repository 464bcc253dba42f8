# Two commands do all the set-up on a fresh machine with Python 3.11+:
#   make demo   -> creates .venv, installs distrain, runs the quickstart (offline)
#   make test   -> runs the whole test suite on both ends of the supported JAX range:
#                  .venv        Python 3.11 + the lowest jax (.ci/lowest.txt)
#                  .venv-newest Python 3.12 + the newest jax the index serves when the
#                               venv is made (it is remade when pyproject.toml changes;
#                               `make clean` to pick up a newer jax)
#                  Without a Python 3.12 the second run is skipped with a message;
#                  under CI=true that is an error.
PYTHON     ?= $(or $(shell .ci/find-python 3.11),python3)
PYTHON_NEW ?= $(shell .ci/find-python 3.12)
VENV       ?= .venv
VENV_NEW   ?= .venv-newest
BIN        := $(VENV)/bin
BIN_NEW    := $(VENV_NEW)/bin
# Two pytest workers (pytest-xdist), a file each at a time: the suite waits on processes
# and compiles in turns, so two workers keep 2 cores busy.
PYTEST_ARGS ?= -q -n 2 --dist loadfile --durations=25

.PHONY: demo test test-lowest test-newest check check-extras bench clean

$(BIN)/.installed: pyproject.toml .ci/lowest.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c .ci/lowest.txt -e '.[dev]'
	touch $@

$(BIN_NEW)/.installed: pyproject.toml
	$(PYTHON_NEW) -m venv $(VENV_NEW)
	$(BIN_NEW)/pip install -q --upgrade pip
	$(BIN_NEW)/pip install -q --upgrade -e '.[dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/distrain train --config configs/quickstart.yaml

test: test-lowest test-newest

# Tests marked one_end("newest") run on the newest end only; with no Python 3.12 (no
# newest run) the lowest end runs them too.
test-lowest: $(BIN)/.installed
	$(MAKE) --no-print-directory check CHECK_BIN=$(BIN) TEST_END=$(if $(PYTHON_NEW),lowest)

test-newest:
	@if [ -z "$(PYTHON_NEW)" ]; then \
	  if [ "$${CI:-}" = "true" ]; then \
	    echo "error: no Python 3.12 found (python3.12 on PATH or pyenv); CI must test the newest jax" >&2; exit 1; \
	  fi; \
	  echo "SKIPPED: the newest-jax run (no Python 3.12 on PATH or in pyenv; jax 0.11+ needs it)"; \
	else \
	  $(MAKE) --no-print-directory $(BIN_NEW)/.installed && \
	  $(MAKE) --no-print-directory check CHECK_BIN=$(BIN_NEW) TEST_END=newest; \
	fi

# One environment's checks (CHECK_BIN: its bin/): lint, types, the suite on 8 virtual
# CPU devices. mypy runs in both: jax's types differ between the range's ends. Each
# environment keeps its own mypy cache (in it), so that neither end's run invalidates
# the other's.
CHECK_BIN ?= $(BIN)
TEST_END  ?=
check:
	@$(CHECK_BIN)/python -c 'import sys, jax; print(f"== Python {sys.version.split()[0]}, jax {jax.__version__}")'
	$(CHECK_BIN)/ruff check distrain tests examples benchmarks
	$(CHECK_BIN)/mypy --cache-dir $(CHECK_BIN)/../.mypy_cache
	DISTRAIN_TEST_END=$(TEST_END) $(CHECK_BIN)/python -m pytest $(PYTEST_ARGS)

# The hardware extras (cuda12, cuda13, tpu) resolve against the index: a dry run each,
# nothing installed. It needs the network, so CI runs it (.ci/run) and `make test` does not.
check-extras: $(BIN)/.installed
	$(BIN)/python .ci/check-extras

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) $(VENV_NEW) runs checkpoints
