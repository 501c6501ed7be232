# Two commands on a fresh machine: `make dev` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: dev test lint typecheck bench wheel-check screenshots clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $(STAMP)

# The whole system on an embedded PostgreSQL under .gpuq/ (Ctrl-C to stop).
dev: $(STAMP)
	$(BIN)/gpuq dev

# The suite includes tiny runs of every bench, so the bench extra is installed too.
# Lint and type-check, then the whole suite on a throwaway PostgreSQL cluster (or
# $$DATABASE_URL, whose gpuq schema the tests drop and recreate). pytest's exit
# code 5 ("no tests collected") is non-zero, so make fails on it like on any failure.
test: $(STAMP)
	$(BIN)/ruff check src tests examples
	$(BIN)/mypy src/gpuq
	$(BIN)/pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples

typecheck: $(STAMP)
	$(BIN)/mypy src/gpuq

# The package as users get it: build the sdist and the wheel (from the sdist), install the wheel
# into a fresh virtualenv outside the source tree, and run gpuq migrate, gpuq serve (/healthz, the
# dashboard) and an agent that runs a job from there, on a throwaway PostgreSQL. About 40 s.
wheel-check:
	$(PYTHON) .ci/wheel_smoke.py

bench: $(STAMP)
	$(BIN)/gpuq bench lease-history
	$(BIN)/gpuq bench throughput --compare pgqueuer

# The README's overview and agents screenshots (docs/img), from the demo in a real Chromium
# (about 40 s); CI=true makes a missing browser an error rather than a skip.
screenshots: $(STAMP)
	CI=true GPUQ_DOCS_SCREENSHOTS=1 GPUQ_SCREENSHOTS=docs/img $(BIN)/pytest -q tests/browser/test_demo_screenshots.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
