"""The HTML report in a real browser: Debian's Chromium, headless.

``kanscale analyze`` writes a report from hand-made records; Chromium opens it from disk, takes a
screenshot, logs every console message to stderr (``--enable-logging=stderr``) and every network
request to a net log (``--log-net-log``). The screenshot must show something, the console must
stay silent (the page has no scripts, so any message is an error: a script error, a
Content-Security-Policy violation) and the page must request nothing over the network. A
deliberately broken page (an external image, a script that throws) is opened the same way first,
so the test is seen to catch both.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from tests.cluster.cli import explain, kanscale
from tests.cluster.daemons import ensure_installed, which
from tests.helpers.records import make_record, write_record

BROWSER = {"chromium": "chromium"}
WINDOW = (1400, 3000)
# Chromium's console lines: [pid:tid:date/time:INFO:CONSOLE:LINE] "message", source: URL (LINE);
# older builds write CONSOLE(LINE). Every level (log, warning, error) is logged at INFO.
CONSOLE = re.compile(r":CONSOLE[:(]\d+\)?\] (.*)")
# Keep the browser's own housekeeping (component updates, sign-in, ...) off the net log where a
# switch allows; what remains is told apart below by its initiator.
QUIET = [
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-domain-reliability",
    "--disable-client-side-phishing-detection",
    "--disable-breakpad",
    "--metrics-recording-only",
    "--no-pings",
    "--disable-field-trial-config",
    "--disable-features=Translate,OptimizationHints,MediaRouter,SpellCheck,"
    "AutofillServerCommunication,CertificateTransparencyComponentUpdater,SafeBrowsing,NetworkTimeServiceQuerying",
]


@dataclass(frozen=True)
class Visit:
    screenshot: Path
    console: list[str]  # every console message
    requests: list[str]  # URLs the page asked for that are neither file: nor data:
    ignored: list[str]  # the browser's own requests, for the failure messages
    stderr: str


@pytest.fixture(scope="module")
def chromium() -> str:
    if which("chromium") is None:
        reason = ensure_installed(BROWSER)
        if reason:
            pytest.skip(f"headless browser: {reason}")
    return which("chromium")


def net_requests(net_log: Path) -> tuple[list[str], list[str]]:
    """(the page's requests, the browser's own) from a Chromium net log, file: and data: left out.
    The browser's own requests start from no origin ("not an origin") and belong to no page (the
    network isolation key names none of file://); a page's request names the page's origin or
    its opaque one ("null")."""
    log = json.loads(net_log.read_text())
    kinds = {number: name for name, number in log["constants"]["logEventTypes"].items()}
    page, browser = [], []
    for event in log["events"]:
        params = event.get("params") or {}
        if kinds[event["type"]] != "URL_REQUEST_START_JOB" or "url" not in params:
            continue
        if params["url"].startswith(("file:", "data:")):
            continue
        own = params.get("initiator") == "not an origin" and "file://" not in params.get("network_isolation_key", "")
        (browser if own else page).append(params["url"])
    return page, browser


def visit(chromium: str, page: Path, tmp_path: Path) -> Visit:
    """Open ``page`` in headless Chromium (its own profile) and return what it showed and did."""
    shot, net_log = tmp_path / f"{page.stem}.png", tmp_path / f"{page.stem}.netlog.json"
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={tmp_path / 'profile'}",
        *QUIET,
        f"--screenshot={shot}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--enable-logging=stderr",
        "--v=0",
        f"--log-net-log={net_log}",
        page.resolve().as_uri(),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the browser's process group: it and the helpers it started
        _, err = proc.communicate()
        raise AssertionError(f"chromium still running after 120 s on {page}\n{err[-4000:]}") from None
    assert proc.returncode == 0 and shot.is_file() and net_log.is_file(), (
        f"chromium exited {proc.returncode}\n{err[-4000:]}"
    )
    page_requests, own = net_requests(net_log)
    return Visit(shot, [m.group(1) for m in CONSOLE.finditer(err)], page_requests, own, err)


def test_the_checks_catch_an_external_request_and_a_throwing_script(chromium, tmp_path):
    broken = tmp_path / "broken.html"
    broken.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>broken</title></head><body><h1>broken</h1>"
        "<img src='http://example.invalid/pixel.png' alt='external'>"
        "<script>throw new Error('deliberate failure')</script></body></html>"
    )
    seen = visit(chromium, broken, tmp_path)
    assert seen.requests == ["http://example.invalid/pixel.png"], (seen.requests, seen.ignored)
    assert any("Uncaught Error: deliberate failure" in message for message in seen.console), seen.stderr[-4000:]


def test_the_report_renders_offline_without_console_messages(chromium, tmp_path):
    runs = tmp_path / "runs"
    for record in [
        make_record("single", strategy="single", world=1, micro_batch=128, samples_per_s=1000),
        make_record("ddp", world=2, micro_batch=64, samples_per_s=1500, comm=0.3),
        make_record("fsdp2", strategy="fsdp2", world=2, micro_batch=64, samples_per_s=1300, state=(200, 200, 400, 0)),
        make_record("mem", study="memory", strategy="fsdp2", world=2, peak_rss=350 * 2**20),
    ]:
        write_record(runs, record)
    done = kanscale("analyze", str(runs), "--out", str(tmp_path / "report"))
    assert done.returncode == 0, explain(done)
    report = tmp_path / "report" / "report.html"
    assert "Content-Security-Policy" in report.read_text()

    seen = visit(chromium, report, tmp_path)
    assert seen.console == [], seen.console
    assert seen.requests == [], f"the report asked the network for {seen.requests}"
    pixels = matplotlib.image.imread(seen.screenshot)
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0])
    ink = np.any(pixels[..., :3] < 0.9, axis=-1).mean()  # share of pixels that are not (near) white
    assert ink > 0.02, f"screenshot nearly blank: {ink:.2%} of pixels drawn"


def dump_dom(chromium: str, page: Path, tmp_path: Path) -> str:
    """The DOM as Chromium built it from ``page``."""
    return subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp_path / 'dom'}",
            *QUIET,
            "--dump-dom",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout


def test_the_verdict_is_the_first_thing_the_browser_shows(chromium, tmp_path):
    """The first section is the verdict, with its findings."""
    runs = tmp_path / "runs"
    for record in [
        make_record("single", strategy="single", world=1, samples_per_s=1000, window=(950, 1050)),
        make_record("ddp", world=2, micro_batch=32, samples_per_s=1500, window=(1400, 1600)),
    ]:
        write_record(runs, record)
    assert kanscale("analyze", str(runs), "--out", str(tmp_path / "report")).returncode == 0
    dom = dump_dom(chromium, tmp_path / "report" / "report.html", tmp_path)
    headings = re.findall(r"<h2>(.*?)</h2>", dom)
    assert headings and headings[0] == "Verdict", headings
    assert "<b>Fastest</b>: ddp at 2 ranks, 1,500 samples/s [1,400-1,600]" in dom


def test_a_fresh_demo_report_opens_offline_with_its_verdict_first(chromium, tmp_path):
    """What `make demo` writes, at its 1M-parameter size: the shipped demo study's five points there
    trained for real (a minute), analysed, and opened in Chromium. (The fast tier plans all ten;
    pykan, the study's other size, trains under every strategy in tests/test_parity.py.)"""
    runs = tmp_path / "demo"
    done = kanscale("sweep", "configs/studies/demo_cpu.yaml", "--out", str(runs), "--only", "size=1M", timeout=900)
    assert done.returncode == 0 and "5 ok" in done.stdout, explain(done)
    analysed = kanscale("analyze", str(runs))
    assert analysed.returncode == 0 and analysed.stdout.startswith("## Verdict"), explain(analysed)
    report = runs / "report" / "report.html"
    seen = visit(chromium, report, tmp_path)
    assert seen.console == [] and seen.requests == [], (seen.console, seen.requests)
    ink = np.any(matplotlib.image.imread(seen.screenshot)[..., :3] < 0.9, axis=-1).mean()
    assert ink > 0.05, f"screenshot nearly blank: {ink:.2%} of pixels drawn"
    dom = dump_dom(chromium, report, tmp_path)
    assert re.findall(r"<h2>(.*?)</h2>", dom)[0] == "Verdict"
    assert dom.count("<b>Fastest</b>") == 1 and "bspline [8, 256, 256, 1]" in dom
