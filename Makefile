# Two entry points: `make demo` (default federation on digits) and `make test` (whole suite).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# protobuf<7 otherwise makes pip backtrack through grpcio-health-checking releases for a minute.
PIN := "grpcio-health-checking<1.82"

.PHONY: install demo bench test lint clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PIP) install -q -e ".[dev]" $(PIN)
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m server.launcher --results results/demo $(ARGS)

# Side-by-side benchmark on the Simulation Engine; override e.g. BENCH_ARGS="--datasets digits --seeds 0".
bench: $(VENV)/.installed
	$(PY) -m server.benchmark --out results/bench $(BENCH_ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q -ra

clean:
	rm -rf results .pytest_cache .ruff_cache .hypothesis
