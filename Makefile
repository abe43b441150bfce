# Two commands do all set-up on a fresh machine:
#   make run    installs daskdist[keras,examples] into .venv (Keras 3, torch's CPU build, scikit-learn, Dask
#               dataframes) and runs the main job: TensorFlow's Keras MirroredStrategy tutorial with real Keras 3
#               (torch backend; examples/keras3_mnist.py) on an embedded local Dask cluster
#   make test   installs daskdist[test,examples] into .venv and runs the test suite
#   (make run-builtin: the same tutorial on the built-in tf.keras-like layers, daskdist[examples] only, no framework;
#   make check runs ruff, mypy and the import-direction check; make test-install runs every install route the README
#   names in a fresh venv; .ci/run runs test, test-ucx, test-install and check)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run run-builtin test test-fast test-random test-install check test-ucx bench install clean gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# each target installs what it needs, no more; the stamps let a later target add its extras to the same venv
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[test,examples]"
	touch $(STAMP)

$(VENV)/.installed-keras: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[keras,examples]"
	touch $@

$(VENV)/.installed-builtin: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[examples]"
	touch $@

install: $(STAMP)

run: $(VENV)/.installed-keras
	KERAS_BACKEND=torch $(BIN)/python examples/keras3_mnist.py $(ARGS)

run-builtin: $(VENV)/.installed-builtin
	$(BIN)/python examples/mnist_mirrored.py $(ARGS)

# every install route the README and docs name, each in a fresh venv (about 30-40 s of pip each, then its examples),
# two routes at a time (pytest-xdist: 181 s -> 130 s on a quiet clean clone, 2026-11-29);
# the route list is tests/install_routes/routes.py, and tests/test_install_routes_documented.py (in `make test`)
# fails when a doc names a route that is not in it
test-install: $(STAMP)
	$(BIN)/python -m pytest tests/install_routes/routes_check.py -q --durations=0 -n 2

# scripts/ensure_chromium.sh installs Debian's chromium for the dashboard browser test when it is missing
# (best effort, never fails; the test skips without it); scripts/ensure_iproute2.sh does the same for `ip`/`tc`
# (iproute2), which the network-namespace host tests need (they skip without it, or without root)
# `make test` runs the tests one at a time (PYTEST_WORKERS=0): on 2 cores, two pytest-xdist workers each starting
# real worker processes (load 15-20) made the kill/elastic tests time out in one run of three and took 26.9 min
# against 19.5 serially (2026-11-25, before the shared cluster, the warm pool and the forked make_cluster workers;
# not re-measured since: it needs a quiet machine, BENCHMARKS.md section 18, "Test suite time"); each xdist worker also starts
# its own shared cluster, warm pool and fork server (tests/conftest.py), so a second one doubles those start-ups;
# where the suite's time goes: DASKDIST_TEST_CPU_LOG=<file> records each test's wall and CPU seconds, and
# `python -m tests.support.cpu_profile <file>` sums them per module;
# `make test PYTEST_WORKERS=2` runs two workers, --dist loadgroup keeping each module's tests on one worker (its
# module-scoped clusters start once) and every netns test in one group (tests/conftest.py). Every test runs.
PYTEST_WORKERS ?= 0
test: $(STAMP)
	-bash scripts/ensure_chromium.sh
	-bash scripts/ensure_iproute2.sh
	$(BIN)/python -m pytest tests -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=15

# for development: no crash/kill tests and no network namespaces (CI runs `make test`, which has them)
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -q -n 2 --dist loadgroup -m "not slow and not netns"

# the whole suite in a random order (pytest-randomly; the seed is printed, rerun one with -p randomly
# --randomly-seed=<seed>): every test must pass alone and in any order
test-random: $(STAMP)
	$(BIN)/python -m pytest tests -q -p randomly -n $(PYTEST_WORKERS) --dist loadgroup

# static checks (configured in pyproject.toml): ruff's lint rules, mypy (strict for all of daskdist) and the
# import-direction contracts (lint-imports); .ci/run runs them
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# the ucx transport's tests: the ucx extra (ucxx-cu12 and the UCX wheels, about 280 MB, a minute to install; it
# imports without a GPU) into the same venv, then only the ucx tests (about 2.5 min on 2 loaded cores, 2026-11-27),
# the namespace-host one included (root); CI runs it after `make test`, which skips them where ucxx is missing
test-ucx: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[test,ucx]"
	$(BIN)/python -m pytest tests/test_transport_ucx.py tests/test_multihost_ucx.py "tests/test_transports.py::test_a_killed_peer_wakes_replicas_blocked_in_the_transport[ucx]" -q

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	$(BIN)/python -m pip install --quiet --no-deps "tf-keras==$$($(BIN)/python -c 'import importlib.metadata as m; v = m.version("tensorflow-cpu").split("."); print(".".join(v[:2]) + ".*")')"
	$(BIN)/python benchmarks/run_overhead.py
	$(BIN)/python benchmarks/allreduce.py

# every GPU test and a short NCCL all-reduce benchmark against torch's NCCL, one table, <= 8 minutes from a fresh
# clone (installs the gpu, torch and keras extras into .venv); without an NVIDIA GPU it says so and exits 0 (docs/gpu.md)
gpu-check:
	$(PYTHON) scripts/gpu_check.py --venv $(VENV)

clean:
	rm -rf $(VENV) build *.egg-info
