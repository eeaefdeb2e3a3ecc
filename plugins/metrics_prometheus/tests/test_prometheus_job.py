"""A real job under ``rallypoint run --metrics prometheus``, scraped by a real Prometheus."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_fixtures import HTTP, fetch

from launch import RALLYPOINT, clean_environment, rallypoint, worker
from servers import PrometheusServer, require_binary, start_prometheus, wait_until

TRAIN = str(Path(__file__).with_name("metrics_train.py"))
STEPS = 20


class Job:
    """``rallypoint run`` in the background, its output collected line by line."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [RALLYPOINT, "run", *args],
            env=clean_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def metrics_port(self, timeout: float = 30) -> int:
        found: list[int] = []

        def logged() -> bool:
            match = re.search(
                r"serving Prometheus metrics on http://[^:]+:(\d+)/metrics", self.output
            )
            if match:
                found.append(int(match.group(1)))
            return bool(found) or self.process.poll() is not None

        assert wait_until(logged, timeout) and found, self.output
        return found[0]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self._reader.join(5)


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "job"
    directory.mkdir()
    return directory


def only(result: list[dict[str, object]]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])  # type: ignore[index]


def test_prometheus_scrapes_a_two_worker_job_through_a_restart(
    tmp_path: Path, job_dir: Path
) -> None:
    require_binary("prometheus", "prometheus")
    job = Job(
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        "--metrics", "prometheus,jsonl",
        "--metrics-conf", f"port=0,addr=127.0.0.1,path={tmp_path / 'events.jsonl'}",
        TRAIN, str(job_dir), str(STEPS),
    )  # fmt: skip
    server: PrometheusServer | None = None
    try:
        port = job.metrics_port()  # port=0: a free port, logged by the agent
        server = start_prometheus(tmp_path, scrape_targets=[f"127.0.0.1:{port}"])
        # Both workers of the first attempt have done their steps.
        assert wait_until(lambda: len(list(job_dir.glob("done-0-*"))) == 2, 30), job.output

        # Prometheus 2.42 scrapes its targets for the first time ~5 s after starting.
        assert only(server.wait_for_query("rallypoint_world_size", timeout=30)) == 2
        series = server.wait_for_query(
            "rallypoint_training_step", lambda r: len(r) == 2, timeout=15
        )
        labels = {tuple(sorted(s["metric"].items())) for s in series}
        run_id = series[0]["metric"]["run_id"]
        assert {dict(s)["rank"] for s in labels} == {"0", "1"}
        assert all(dict(s)["role"] == "default" and dict(s)["node"] for s in labels)
        assert {s["value"][1] for s in series} == {str(STEPS - 1)}
        assert only(server.query('rallypoint_restarts_total{cause="failure"}')) == 0

        (job_dir / "crash").touch()  # rank 1 exits with 3; the agent restarts both
        assert wait_until(lambda: len(list(job_dir.glob("done-1-*"))) == 2, 30), job.output

        restarts = server.wait_for_query(
            'rallypoint_restarts_total{cause="failure"}',
            lambda r: len(r) == 1 and r[0]["value"][1] == "1",
            timeout=15,
        )
        assert restarts[0]["metric"]["run_id"] == run_id
        # The step counter is the sum of both attempts; the gauges are the live workers'
        # only: the dead ones' are gone, not added.
        server.wait_for_query(
            "sum(test_steps_total)", lambda r: bool(r) and r[0]["value"][1] == str(4 * STEPS), 15
        )
        assert only(server.query("sum(test_live_workers)")) == 2
        assert only(server.query("sum(rallypoint_training_samples_total)")) == 4 * STEPS * 4
        assert only(server.query("sum(test_step_seconds_count)")) == 4 * STEPS
        failures = server.query("rallypoint_worker_failures_total")
        assert [(f["metric"]["exit_reason"], f["value"][1]) for f in failures] == [
            ("exit_code_3", "1")
        ]
        assert only(server.query("rallypoint_checkpoint_save_seconds_count")) == 2
        assert only(server.query("rallypoint_agent_state")) == 2

        # The live endpoint, worker metrics included, passes promtool.
        promtool = require_binary("promtool", "prometheus")
        checked = subprocess.run(
            [promtool, "check", "metrics"],
            input=fetch(f"http://127.0.0.1:{port}/metrics"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")

        (job_dir / "finish").touch()
        assert job.process.wait(timeout=30) == 0, job.output
    finally:
        job.stop()
        if server is not None:
            server.stop()
    # jsonl was fed the same events alongside.
    names = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").open()]
    assert names.count("workers_restarted") == 1 and names[-1] == "agent_stopping"


def test_prometheus_evaluates_the_goodput_of_a_job_through_a_killed_worker(
    tmp_path: Path,
) -> None:
    """A real Prometheus scrapes a job whose worker is SIGKILLed, and evaluates the shipped
    goodput alerts with thresholds that decide their state: firing, pending, inactive."""
    from test_prometheus_rules import alert_rules

    require_binary("prometheus", "prometheus")
    stop = tmp_path / "stop"
    job = Job(
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        "--checkpoint-memory", "64MB", "--checkpoint-dir", str(tmp_path / "checkpoints"),
        "--metrics", "prometheus", "--metrics-port", "0", "--metrics-conf", "addr=127.0.0.1",
        worker("mem_train.py"), "100000", "--step-seconds", "0.1", "--stop-file", str(stop),
    )  # fmt: skip
    server: PrometheusServer | None = None
    try:
        server = start_prometheus(tmp_path, scrape_targets=[f"127.0.0.1:{job.metrics_port()}"])
        shipped = alert_rules()
        goodput, recovery = shipped["RallypointGoodputLow"], shipped["RallypointRecoverySlow"]
        low = threshold(goodput["expr"], " < 0.9")
        slow = threshold(recovery["expr"], " > 300")
        # (group, alert, expr, for, the state it must reach)
        rules = [
            ("fire", "RallypointGoodputLow", f"{low} < 1.01", "0s", "firing"),
            ("fire", "RallypointRecoverySlow", f"{slow} > 0", "0s", "firing"),
            ("pend", "RallypointGoodputLow", f"{low} < 1.01", goodput["for"], "pending"),
            ("quiet", "RallypointGoodputLow", f"{low} < 0", "0s", "inactive"),
            ("quiet", "RallypointRecoverySlow", recovery["expr"], "0s", "inactive"),
        ]
        load_rules(server, tmp_path / "goodput.rules.yml", rules)

        # Scraped while it trains, before the failure: Prometheus sees every counter of it
        # change (they exist from the start, at 0).
        server.wait_for_query("rallypoint_checkpoint_step >= 20", timeout=60)
        pid = re.search(r"rank=1 pid=(\d+)", job.output)
        assert pid, job.output
        os.kill(int(pid.group(1)), signal.SIGKILL)

        server.wait_for_query(
            'rallypoint_failures_total{cause="SIGKILL"} == 1', timeout=30
        )  # the agent restarts both workers, which resume from node memory
        server.wait_for_query("rallypoint_recovery_seconds_count == 1", timeout=30)
        assert only(server.query("rallypoint_failure_detect_seconds_count")) == 1
        assert only(server.query("sum(rallypoint_failures_total)")) == 1
        # A checkpoint every step: at most a few steps are trained again.
        assert only(server.query("rallypoint_steps_redone_total")) < 10
        assert 0 < only(server.query("rallypoint_goodput_ratio")) < 1
        for phase in ("training", "restart", "loading"):
            assert only(server.query(f'rallypoint_phase_seconds_total{{phase="{phase}"}}')) > 0
        assert 0 < only(server.query(low)) < 1  # the alert's goodput, over the last hour
        assert 0 < only(server.query(slow)) < 300  # ... and recovery time

        def states() -> dict[tuple[str, str], tuple[str, str]]:
            groups = json.loads(fetch(f"{server.url}/api/v1/rules"))["data"]["groups"]
            return {
                (group["name"], rule["name"]): (rule["state"], rule["health"])
                for group in groups
                for rule in group["rules"]
            }

        expected = {(group, alert): (state, "ok") for group, alert, _, _, state in rules}
        assert wait_until(lambda: states() == expected, 30), (states(), expected)
        # Recomputed at every scrape, the phase counters never went down.
        assert only(server.query("max(resets(rallypoint_phase_seconds_total[10m]))")) == 0

        stop.touch()  # every rank stops at the same step
        assert job.process.wait(timeout=60) == 0, job.output
    finally:
        job.stop()
        if server is not None:
            server.stop()


def threshold(expr: str, comparison: str) -> str:
    """``expr`` without its comparison at the end, which this test replaces."""
    assert expr.endswith(comparison), (expr, comparison)  # the threshold was changed
    return expr.removesuffix(comparison)


def load_rules(server: PrometheusServer, path: Path, rules: list[tuple[str, ...]]) -> None:
    """Have ``server`` evaluate ``rules`` ((group, alert, expr, for, ...)), written to
    ``path``."""
    groups: dict[str, list[dict[str, str]]] = {}
    for group, alert, expr, duration, *_ in rules:
        groups.setdefault(group, []).append({"alert": alert, "expr": expr, "for": duration})
    # JSON is valid YAML, and needs no YAML library.
    path.write_text(json.dumps({"groups": [{"name": n, "rules": r} for n, r in groups.items()]}))
    config = json.loads(server.config_path.read_text())
    config["rule_files"] = [str(path)]
    server.config_path.write_text(json.dumps(config))
    HTTP.open(urllib.request.Request(f"{server.url}/-/reload", method="POST"), timeout=10)


def test_workers_get_a_metrics_directory_only_for_a_sink_that_reads_it(tmp_path: Path) -> None:
    def environment(*metrics: str) -> dict[str, str]:
        result = rallypoint(
            "run", "--standalone", "--nproc-per-node", "1", *metrics,
            "--log-dir", str(tmp_path), worker("dump_env.py"), timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        line = next(x for x in result.stdout.splitlines() if ":{" in x)
        env: dict[str, str] = json.loads(line.split(":", 1)[1])
        return env

    jsonl = f"path={tmp_path / 'events.jsonl'}"
    assert "RALLYPOINT_METRICS_DIR" not in environment(
        "--metrics", "log,jsonl", "--metrics-conf", jsonl
    )
    env = environment("--metrics", "prometheus", "--metrics-conf", "addr=127.0.0.1")
    directory = Path(env["RALLYPOINT_METRICS_DIR"])
    assert directory.name == "metrics" and directory.parent.parent == tmp_path
    assert not directory.exists()  # the agent removed it when it stopped


def test_without_the_plugin_prometheus_is_an_unknown_sink(tmp_path: Path) -> None:
    result = rallypoint(
        "run", "--standalone", "--metrics", "prometheus", worker("dump_env.py"),
        env={"RALLYPOINT_DISABLE_PLUGINS": "prometheus"}, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        "--metrics 'prometheus': unknown metrics sink. Choose one of: jsonl, log." in result.stderr
    ), result.stderr
    assert "Traceback" not in result.stderr


def test_the_digits_example_feeds_every_training_panel_of_the_dashboard(tmp_path: Path) -> None:
    """docs/monitoring.md says so: run the example with --metrics prometheus and every
    worker metric the dashboard reads is served."""
    from test_prometheus_rules import dashboard_expressions, metric_names

    pytest.importorskip("sklearn")
    example = Path(__file__).resolve().parents[3] / "examples" / "train_digits.py"
    wanted = {
        name.removesuffix("_bucket")
        for expr in dashboard_expressions()
        for name in metric_names(expr)
        if name.startswith("rallypoint_training_")
    }
    assert "rallypoint_training_samples_per_second" in wanted
    job = Job(
        "--nproc-per-node", "2", "--metrics", "prometheus", "--metrics-port", "0",
        str(example), "--epochs", "50", "--step-seconds", "0.05",
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{job.metrics_port()}/metrics"

        def served() -> set[str]:
            text = fetch(url)
            return {line.split("{")[0].removesuffix("_bucket") for line in text.splitlines()}

        assert wait_until(lambda: wanted <= served(), 120), (wanted - served(), job.output)
    finally:
        job.stop()
