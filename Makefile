# The two commands of the README: `make demo` and `make test`. Everything they need is set
# up here, on a fresh machine, by the targets below.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PLUGINS := plugins/rendezvous_etcd plugins/rendezvous_redis plugins/metrics_prometheus examples/fsspec_store
STAMP := $(VENV)/.installed
# Debian packages of the programs the tests start, binary:package: the servers, and the
# headless browser that renders `rallypoint report --html` (tests/test_report.py).
SERVERS := etcd:etcd-server redis-server:redis-server prometheus:prometheus prometheus-pushgateway:prometheus-pushgateway openssl:openssl slurmctld:slurm-wlm chromium:chromium

.PHONY: install servers lint docs test suite lock test-latest test-lowest soak reliability demo bench bench-peers clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# The development environment is locked (docs/development.md): requirements/dev.txt pins,
# with hashes, every package that requirements/dev.in (the project's extras, the plugins'
# dependencies, the tools) and torch.in (torch's CPU build) ask for; `make lock` writes it.
LOCK := requirements/dev.txt
LOCK_INPUT := requirements/dev.in
TORCH_INPUT := requirements/torch.in
LOCK_PYTHON := 3.11
# Where pip and uv find torch's CPU build: the machine's own --find-links for pip where it
# sets one (a local copy), else PyTorch's index of CPU builds. PyPI has only CUDA builds of
# several gigabytes.
TORCH_FIND_LINKS ?= $(or $(PIP_FIND_LINKS),https://download.pytorch.org/whl/cpu/torch/)
LOCAL_PACKAGES := rallypoint rallypoint-etcd rallypoint-redis rallypoint-prometheus rallypoint-fsspec
UV := $(VENV)/bin/uv

# The lock exactly (complete, so --no-deps; every file's hash checked), then this checkout's
# distributions, editable, on top of it.
$(STAMP): $(LOCK) pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS)) | $(PY)
	@$(PY) -c 'import sys; v = "%d.%d" % sys.version_info[:2]; sys.exit(v != "$(LOCK_PYTHON)" and f"$(LOCK) is for Python $(LOCK_PYTHON), $(VENV) has {v}: make clean, then make PYTHON=python$(LOCK_PYTHON)")'
	$(PIP) install -q --require-hashes --no-deps --find-links $(TORCH_FIND_LINKS) -r $(LOCK)
	$(PIP) install -q --no-deps --no-build-isolation -e . $(addprefix -e ,$(PLUGINS))
	touch $@

install: $(STAMP)

# Installs the servers the tests need with apt-get when they are missing and we are root.
servers:
	@missing=""; \
	for pair in $(SERVERS); do \
		command -v "$${pair%%:*}" >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing$$missing with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else \
		echo "warning: missing$$missing; install with: sudo apt-get install$$missing (their tests skip, or fail under CI)"; \
	fi

# lint-imports: the boundaries of the plugin API (pyproject.toml, [tool.importlinter]); the
# example plugin checks itself from its own folder, as a third party's plugin would.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache
	cd docs/plugins/example-plugin && $(abspath $(VENV))/bin/lint-imports --no-cache

# Not --quiet: it hides the warnings that --strict turns into a failure.
docs: install
	$(VENV)/bin/mkdocs build --strict --site-dir "$$(mktemp -d)"

# Most tests wait on real servers and agents, so they run on TEST_PROCESSES processes (on
# 2 cores too); the few that change the installed environment run alone afterwards.
TEST_PROCESSES ?= 3
test: lint docs suite

suite: install servers
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist worksteal -m "not serial and not soak"
	$(PY) -m pytest -m serial

# requirements/dev.in resolved anew: the newest releases within the declared ranges.
lock: install
	$(UV) pip compile $(LOCK_INPUT) $(TORCH_INPUT) --upgrade --generate-hashes --python-version $(LOCK_PYTHON) \
		--find-links $(TORCH_FIND_LINKS) $(addprefix --no-emit-package ,$(LOCAL_PACKAGES)) \
		--custom-compile-command "make lock" --quiet -o $(LOCK)

# make test against the newest releases, without the lock, in a venv of its own: an
# upstream release that breaks us shows here, on our schedule, not in CI.
LATEST := .venv-latest
test-latest: install
	rm -rf $(LATEST)
	$(UV) venv -q --seed --python $(PYTHON) $(LATEST)
	VIRTUAL_ENV=$(LATEST) $(UV) pip install -q --find-links $(TORCH_FIND_LINKS) \
		-r $(LOCK_INPUT) -r $(TORCH_INPUT)
	touch $(LATEST)/.installed
	$(MAKE) VENV=$(LATEST) test

# The suite against the oldest releases that the declared ranges allow (uv's lowest-direct:
# each distribution's own requirements at their lower bounds), torch's lowest too (PyPI's
# build, with CUDA: some 3 GB the first time): those bounds are true. Not lint and docs,
# whose findings change with their tools' versions.
LOWEST := .venv-lowest
test-lowest: install
	rm -rf $(LOWEST)
	$(UV) venv -q --seed --python $(PYTHON) $(LOWEST)
	VIRTUAL_ENV=$(LOWEST) $(UV) pip install -q --resolution lowest-direct -r $(LOCK_INPUT)
	touch $(LOWEST)/.installed
	$(MAKE) VENV=$(LOWEST) suite

# The long fault scenarios (docs/reliability.md): the 20-repetition recovery soak, membership
# churn, and the backends that make test leaves out of the faults handled alike on each;
# then 10,000 seeded schedules of the rendezvous protocol's simulation and 200 of jobs of
# 64 nodes, and the first seed that catches each defect kept in tests/simulation_mutants.py
# (docs/index.md).
soak: install servers
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist worksteal -m soak
	$(PY) -m rallypoint.testing.simulation --schedules 10000 --processes $(TEST_PROCESSES)
	$(PY) -m rallypoint.testing.simulation --schedules 200 --nodes 64 --processes $(TEST_PROCESSES)
	$(PY) tests/simulation_mutants.py 3000

# Runs the fault suite and writes docs/reliability.md from what it measured.
reliability: install servers
	$(PY) docs/gen_reliability.py

DEMO_DIR := .demo
# Two nodes on this machine (c10d): node a trains alone, node b gets ready beside it and
# joins (world size 4), node b is SIGKILLed and node a finishes alone; each round resumes
# from the newest checkpoint.
# Then where the job's time went, from both nodes' event logs (docs/report.md).
demo: install
	$(PY) examples/elastic_demo.py --dir $(DEMO_DIR)
	$(VENV)/bin/rallypoint report $(DEMO_DIR)/events-a.jsonl $(DEMO_DIR)/events-b.jsonl --html $(DEMO_DIR)/report.html

# Side-by-side measurements against torchrun; write benchmarks/results/ and docs/benchmarks*.md.
# bench_memory.py and bench_goodput.py start redis-server (make servers installs it).
bench: install
	$(PY) benchmarks/bench_launcher.py
	$(PY) benchmarks/bench_rendezvous.py
	$(PY) benchmarks/bench_recovery.py
	$(PY) benchmarks/bench_recovery.py --kill preempt
	$(PY) benchmarks/bench_checkpoint.py
	$(PY) benchmarks/bench_memory.py
	$(PY) benchmarks/bench_metrics.py
	$(PY) benchmarks/bench_progress.py
	$(PY) benchmarks/bench_goodput.py
	$(PY) benchmarks/bench_scale.py
	$(PY) benchmarks/bench_scrape.py

# Recovery beside the launchers users would pick instead (docs/benchmarks-peers.md): each
# peer is installed from PyPI into .bench-peers/ on first use; make test installs none.
bench-peers: install
	$(PY) benchmarks/bench_peers.py

clean:
	rm -rf $(VENV) $(LATEST) $(LOWEST) site .pytest_cache .mypy_cache .ruff_cache $(DEMO_DIR)
