"""``rallypoint report``: the account of a real job's event log as text, JSON and an HTML
page, the page rendered by a real headless browser (Debian's chromium)."""

from __future__ import annotations

import html
import itertools
import json
import re
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from launch import rallypoint, worker
from rallypoint import goodput
from rallypoint_cli import report_html
from servers import require_binary

#: Rank 1 SIGKILLs itself in step 20; the job restarts once from node memory and finishes.
KILLED_RUN = (
    "--nproc-per-node", "2", "--max-restarts", "1", "--checkpoint-memory", "64MB",
    worker("mem_train.py"), "40", "--step-seconds", "0.1", "--kill-rank", "1", "--kill-at", "20",
)  # fmt: skip


@pytest.fixture(scope="module")
def event_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The event log of one real run of ``KILLED_RUN``, alone in its directory."""
    log = tmp_path_factory.mktemp("logs") / "events.jsonl"
    done = rallypoint("run", "--event-log", str(log), *KILLED_RUN, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return log


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return rallypoint("report", *args, timeout=60)


def report_json(*args: str) -> dict[str, Any]:
    done = report(*args, "--json")
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


# --- text and JSON ----------------------------------------------------------------------------


def test_the_summary_names_goodput_phases_the_failure_and_the_steps_redone(
    event_log: Path,
) -> None:
    done = report(str(event_log))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    text = done.stdout
    assert re.match(r"goodput \d+\.\d%: 1 node, \d+ s of wall time", text), text
    for phase in (goodput.STARTUP, goodput.TRAINING, goodput.RESTART):
        assert re.search(rf"^  {phase} +\d+\.\d +\d+\.\d%$", text, re.MULTILINE), text
    assert "failures: 1 (SIGKILL 1)" in text
    assert re.search(r"^steps redone: [01]$", text, re.MULTILINE), text  # saved every step


def test_the_json_agrees_with_the_text(event_log: Path) -> None:
    text = report(str(event_log)).stdout
    data = report_json(str(event_log))
    assert text.startswith(f"goodput {data['goodput']:.1%}: ")
    rows = dict(re.findall(r"^  (\w+) +(\d+\.\d) +\d+\.\d%$", text, re.MULTILINE))
    shown = {p: s for p, s in data["phases"].items() if s > 0 or p == goodput.TRAINING}
    assert rows == {phase: f"{seconds:.1f}" for phase, seconds in shown.items()}
    assert sum(data["phases"].values()) == pytest.approx(data["node_seconds"])
    assert (data["failures"], data["failures_by_cause"]) == (1, {"SIGKILL": 1})
    [incident] = data["incidents"]
    assert incident["steps_redone"] == data["steps_redone"]
    assert f"steps redone: {data['steps_redone']}" in text
    assert f"worst {data['recover_seconds']['worst']:.1f} s" in text
    [node] = data["nodes"]
    assert [(r["round"], r["world_size"]) for r in node["rounds"]] == [(0, 2), (1, 2)]
    assert {source for _, _, source in node["loads"]} == {"memory"}


def test_a_directory_of_logs_reads_as_its_files(event_log: Path) -> None:
    assert report_json(str(event_log.parent)) == report_json(str(event_log))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (lambda log, tmp: [str(tmp / "nowhere.jsonl")], "nowhere.jsonl: no such event log"),
        (lambda log, tmp: [str(tmp)], "holds no event log (*.jsonl)"),
        (lambda log, tmp: [str(tmp / "notes.txt")], "no rallypoint event in it"),
        (lambda log, tmp: [str(log), "--html", str(tmp / "no" / "r.html")], "cannot write it"),
        (lambda log, tmp: [str(log), "--html", str(tmp)], "cannot write it (Is a directory)"),
        (lambda log, tmp: [], "Missing argument 'EVENT_LOG...'"),
    ],
    ids=[
        "missing",
        "empty-directory",
        "no-events",
        "html-directory-missing",
        "html-is-a-dir",
        "none",
    ],
)
def test_bad_input_is_one_sentence_and_exit_code_2(
    event_log: Path, tmp_path: Path, args: Any, message: str
) -> None:
    (tmp_path / "notes.txt").write_text("not an event\n")
    done = report(*args(event_log, tmp_path))
    assert (done.returncode, done.stdout) == (2, ""), done.stdout + done.stderr
    assert done.stderr.startswith("rallypoint: error: ") and done.stderr.count("\n") == 1
    assert message in done.stderr


# --- the HTML page ----------------------------------------------------------------------------


class Elements(HTMLParser):
    """Every start tag of a page, with its attributes, and its text."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {name: value or "" for name, value in attrs}))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def of_class(self, name: str) -> list[dict[str, str]]:
        return [a for _, a in self.tags if name in a.get("class", "").split()]


def test_the_page_is_self_contained_and_escapes_what_the_log_says() -> None:
    """A log is data from the cluster: a node id or signal name holding markup stays text."""
    hostile = '<img src=x onerror="alert(1)">'
    records = [
        {"event": "agent_started", "wall_time": 0.0, "node": f"n{hostile}", "host": hostile},
        {"event": "rendezvous_started", "wall_time": 0.0, "node": f"n{hostile}"},
        {"event": "workers_started", "wall_time": 1.0, "node": f"n{hostile}", "round": 0},
        {"event": "progress", "wall_time": 2.0, "node": f"n{hostile}", "step": 1},
        {"event": "worker_failed", "wall_time": 3.0, "node": f"n{hostile}", "signal": hostile},
    ]
    page = report_html.render(goodput.account(records))
    elements = Elements(page)
    assert "img" not in {tag for tag, _ in elements.tags}
    assert [a["data-cause"] for a in elements.of_class("failure")] == [hostile]
    assert f"node n{hostile}" in "".join(elements.text)
    # Nothing to fetch: no element or attribute that loads a script, style, image or font.
    fetching = {"script", "link", "img", "image", "iframe", "object", "embed", "use"}
    assert fetching.isdisjoint(tag for tag, _ in elements.tags)
    assert not any({"src", "href", "xlink:href"} & set(attrs) for _, attrs in elements.tags)
    assert "url(" not in page and "@import" not in page


def test_the_slowest_recovery_comes_first() -> None:
    """Two failures: a SIGKILL the job recovers from in 2 s, an exit code 1 in 9 s."""
    timeline = [
        ("agent_started", 0, {}), ("rendezvous_started", 0, {}),
        ("rendezvous_completed", 1, {"round": 0}), ("workers_started", 2, {"round": 0}),
        ("progress", 3, {"step": 0}), ("progress", 5, {"step": 2}),
        ("worker_failed", 6, {"timestamp": 6, "detected": 6.5, "signal": "SIGKILL"}),
        ("rendezvous_started", 6.5, {}), ("rendezvous_completed", 7, {"round": 1}),
        ("workers_started", 7.5, {"round": 1}), ("progress", 8, {"step": 3}),
        ("progress", 10, {"step": 5}),
        ("worker_failed", 11, {"timestamp": 11, "detected": 11.1, "exit_code": 1}),
        ("rendezvous_started", 11.1, {}), ("rendezvous_completed", 12, {"round": 2}),
        ("workers_started", 12.5, {"round": 2}), ("progress", 20, {"step": 6}),
        ("agent_stopping", 21, {"exit_code": 0}),
    ]  # fmt: skip
    records = [
        {"event": name, "wall_time": float(at), "node": "n1", "host": "h", **fields}
        for name, at, fields in timeline
    ]
    elements = Elements(report_html.render(goodput.account(records)))
    rows = [a for tag, a in elements.tags if tag == "tr" and "data-recover" in a]
    assert [float(a["data-recover"]) for a in rows] == [pytest.approx(9), pytest.approx(2)]
    assert [a["data-cause"] for a in elements.of_class("failure")] == ["SIGKILL", "exit code 1"]
    assert [a["data-round"] for a in elements.of_class("round")] == ["0", "1", "2"]
    assert len(elements.of_class("restart")) == 2


#: Injected into a copy of the page: after layout, what lies outside the window or its SVG,
#: written into the DOM for --dump-dom to show.
LAYOUT_CHECK = """<pre id="layout-check"></pre><script>
(() => {
  const width = document.documentElement.clientWidth;
  const box = (el) => el.getBoundingClientRect();
  const inside = (a, b) => a.left >= b.left - 0.5 && a.right <= b.right + 0.5
    && a.top >= b.top - 0.5 && a.bottom <= b.bottom + 0.5;
  const name = (el) => `${el.tagName}.${el.getAttribute("class") || ""} `
    + (el.textContent || "").slice(0, 40);
  const out = {width, scrollWidth: document.documentElement.scrollWidth, cut: []};
  for (const el of document.querySelectorAll("main *")) {
    const b = box(el);
    if ((b.width || b.height) && (b.left < -0.5 || b.right > width + 0.5)) out.cut.push(name(el));
  }
  for (const svg of document.querySelectorAll("svg")) {
    for (const el of svg.querySelectorAll("text, rect, line, path")) {
      if (!inside(box(el), box(svg))) out.cut.push(`outside its svg: ${name(el)}`);
    }
  }
  for (const round of document.querySelectorAll("g.round")) {
    const label = round.querySelector("text");
    if (label && !inside(box(label), box(round.querySelector("rect")))) {
      out.cut.push(`round label past its bar: ${name(label)}`);
    }
  }
  out.bars = [...document.querySelectorAll("rect.phase")].filter((r) => box(r).width > 0).length;
  document.getElementById("layout-check").textContent = JSON.stringify(out);
})();
</script>"""


def chromium(tmp_path: Path, page: Path, *flags: str) -> str:
    """Run headless chromium on ``page``; its stdout."""
    binary = require_binary("chromium", "chromium")
    command = [
        binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", *flags, page.as_uri(),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_browser_shows_every_round_and_failure_and_cuts_nothing_off(
    event_log: Path, tmp_path: Path
) -> None:
    page = tmp_path / "report.html"
    done = report(str(event_log), "--html", str(page))
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(f"HTML report: {page}\n")
    data = report_json(str(event_log))
    [node] = data["nodes"]
    checked = tmp_path / "checked.html"
    checked.write_text(page.read_text().replace("</main>", f"</main>{LAYOUT_CHECK}"))
    for width in (1280, 520):  # a desktop, a phone (chromium's narrowest is 500)
        rendered = chromium(tmp_path, checked, f"--window-size={width},900", "--dump-dom")
        found = re.search(r'<pre id="layout-check">(.*?)</pre>', rendered, re.DOTALL)
        assert found, rendered[-2000:]
        result = json.loads(html.unescape(found.group(1)))
        assert result["width"] == width and result["scrollWidth"] <= width, result
        assert result["cut"] == [] and result["bars"] > 0, result
        dom = Elements(rendered)
        rounds = [(int(a["data-round"]), int(a["data-world-size"])) for a in dom.of_class("round")]
        assert rounds == [(r["round"], r["world_size"]) for r in node["rounds"]]
        assert [a["data-cause"] for a in dom.of_class("failure")] == ["SIGKILL"]
        assert len(dom.of_class("restart")) == len(node["rounds"]) - 1
        loads = {int(a["data-step"]) for a in dom.of_class("load")}
        assert loads == {step for _, step, _ in node["loads"]}
        saves = [int(a["data-step"]) for a in dom.of_class("save")]
        # Saves less than a pixel apart are one tick; 0.1 s steps are several pixels apart.
        assert len(node["saves"]) // 2 < len(saves) <= len(node["saves"])
        assert set(saves) <= {step for _, step in node["saves"]}
    screenshot = tmp_path / "report.png"
    chromium(tmp_path, page, "--window-size=1280,900", f"--screenshot={screenshot}")
    head = screenshot.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (1280, 900)


def test_the_phase_bar_covers_every_second_of_the_node(event_log: Path) -> None:
    """The bar's columns abut from the node's first event to its last, each filled to its
    height; a phase that lasted two pixels or more has a rect of its own colour."""
    data = report_json(str(event_log))
    records, _ = goodput.read([event_log])
    bars = Elements(report_html.render(goodput.account(records))).of_class("phase")
    columns: dict[tuple[float, float], float] = {}
    for a in bars:
        edges = (float(a["x"]), float(a["x"]) + float(a["width"]))
        columns[edges] = columns.get(edges, 0.0) + float(a["height"])
    ordered = sorted(columns)
    assert ordered[0][0] == pytest.approx(report_html.LEFT)
    assert ordered[-1][1] == pytest.approx(report_html.WIDTH - report_html.RIGHT, abs=0.01)
    assert all(b[0] == pytest.approx(a[1], abs=0.02) for a, b in itertools.pairwise(ordered))
    assert all(h == pytest.approx(report_html.BAR_H, abs=0.05) for h in columns.values())
    pixels = (report_html.WIDTH - report_html.LEFT - report_html.RIGHT) / data["wall_seconds"]
    [node] = data["nodes"]
    wide = {phase for start, end, phase in node["segments"] if (end - start) * pixels >= 2}
    assert wide <= {a["data-phase"] for a in bars}
    assert {"startup", "training", "restart"} <= wide


def test_a_long_job_stays_a_small_page() -> None:
    """Two days with a save every minute that holds training up for 6 s: phases and ticks
    closer than a pixel are drawn as one, so the page grows with the width of the
    timeline, not with the job, and the saves' 10% still shows."""
    node = {"node": "n1", "host": "h"}
    records = [
        {"event": "agent_started", "wall_time": 0.0, **node},
        {"event": "workers_started", "wall_time": 5.0, "round": 0, "world_size": 8, **node},
    ]
    saves = range(60, 2 * 86400, 60)
    records += [
        {"event": "checkpoint_saved", "wall_time": float(at), "step": at // 60, "seconds": 6.0,
         "blocked_seconds": 6.0, **node}
        for at in saves
    ]  # fmt: skip
    records.append({"event": "agent_stopping", "wall_time": 2 * 86400.0, "exit_code": 0, **node})
    account = goodput.account(records)
    assert len(account.nodes[0].segments) > 2 * len(saves)
    page = report_html.render(account)
    elements = Elements(page)
    bars = elements.of_class("phase")
    assert len(bars) <= 2 * report_html.WIDTH and len(page) < 500_000
    area = {phase: 0.0 for phase in goodput.PHASES}
    for a in bars:
        area[a["data-phase"]] += float(a["width"]) * float(a["height"])
    assert area[goodput.CHECKPOINT] / sum(area.values()) == pytest.approx(0.1, abs=0.01)
    assert 0 < len(elements.of_class("save")) <= report_html.WIDTH
    ticks = re.findall(r'<text class="tick"[^>]*>([^<]*)</text>', page)
    assert ticks[0] == "0" and ticks[-1] == "48 h", ticks
