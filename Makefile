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

.PHONY: install servers lint docs test soak reliability demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: pip finds a CPU build locally; letting the project's torch range pick
# one would download a multi-gigabyte CUDA build.
$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS)) | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]' $(addprefix -e ,$(PLUGINS))
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
test: install servers lint docs
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist worksteal -m "not serial and not soak"
	$(PY) -m pytest -m serial

# The long fault scenarios (docs/reliability.md): the 20-repetition recovery soak, membership
# churn, and the backends that make test leaves out of the faults handled alike on each.
soak: install servers
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist worksteal -m soak

# Runs the fault suite and writes docs/reliability.md from what it measured.
reliability: install servers
	$(PY) docs/gen_reliability.py

DEMO_DIR := .demo
EXAMPLES_STAMP := $(VENV)/.installed-examples
$(EXAMPLES_STAMP): $(STAMP)
	$(PIP) install -q -e '.[examples]'
	touch $@

# Two nodes on this machine (c10d): node a trains alone, node b joins (world size 4), node b
# is SIGKILLed and node a finishes alone; each round resumes from the newest checkpoint.
# Then where the job's time went, from both nodes' event logs (docs/report.md).
demo: $(EXAMPLES_STAMP)
	$(PY) examples/elastic_demo.py --dir $(DEMO_DIR)
	$(VENV)/bin/rallypoint report $(DEMO_DIR)/events-a.jsonl $(DEMO_DIR)/events-b.jsonl --html $(DEMO_DIR)/report.html

# Side-by-side measurements against torchrun; write benchmarks/results/ and docs/benchmarks*.md.
# bench_memory.py and bench_goodput.py start redis-server (make servers installs it).
bench: install
	$(PIP) install -q -e '.[bench]'
	$(PY) benchmarks/bench_launcher.py
	$(PY) benchmarks/bench_rendezvous.py
	$(PY) benchmarks/bench_recovery.py
	$(PY) benchmarks/bench_recovery.py --kill preempt
	$(PY) benchmarks/bench_checkpoint.py
	$(PY) benchmarks/bench_memory.py
	$(PY) benchmarks/bench_metrics.py
	$(PY) benchmarks/bench_goodput.py

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache $(DEMO_DIR)
