"""The operator view (issue 26): the live page in a real headless browser with real
workers (one killed with -9), `GET /v1/fleet`'s event log and counters, `polyrl status`,
and `polyrl report` on real run directories.

The report fixtures in tests/data/runs are the first 40 steps of two real runs of the
main job on CPU (`polyrl train`, defaults: remote mode with two launched workers; and
`rollout.mode=local`), with their config.toml.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import dump_dom, find_chromium, screenshot
from rich.console import Console

from chaos_harness.harness import TOKEN, chaos_manager_config, free_port, make_batch, spawn_worker, wait_for
from polyrl.cli import main as cli_main
from polyrl.config import load_config
from polyrl.manager.fleet import FleetStatus, fleet_status
from polyrl.manager.main import ManagerThread
from polyrl.protocol.manager_api import BatchError, FleetDecision, RegisterRequest
from polyrl.report import PANELS, ReportError, draw, load_runs, report
from polyrl.rollout.manager_link import ManagerLink
from polyrl.status import status

RUNS = Path(__file__).parent / "data" / "runs"
RUN_COLORS = ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E))
"""matplotlib's C0 and C1: the first and second run's lines in a panel."""
DOCS_SCREENSHOT = Path(__file__).parent.parent / "docs" / "operator-page.png"
PNG = b"\x89PNG\r\n\x1a\n"
Worker = subprocess.Popen[bytes]


def chromium() -> str:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium binary (scripts/setup.sh installs Debian's as root; or set POLYRL_CHROMIUM)")
    return binary


def active_ids(mt: ManagerThread) -> set[str]:
    return {w.worker_id for w in mt.worker_list().workers if w.state == "active"}


def worker_row(dom: str, worker_id: str) -> str | None:
    match = re.search(rf'<tr id="worker-{worker_id}"[^>]*>.*?</tr>', dom, re.S)
    return match.group(0) if match else None


def register_fake(mt: ManagerThread, worker_id: str, usd_per_hour: float | None = None, local: bool = False) -> None:
    """A worker record that serves nothing (no batch dials it): fast tests of the views."""
    request = RegisterRequest(
        worker_id=worker_id,
        url=f"http://127.0.0.1:{free_port()}",
        model_path="m",
        weight_version=0,
        max_num_seqs=4,
        max_model_len=64,
        usd_per_hour=usd_per_hour,
        device="cpu",
        local=local,
    )

    def add() -> None:
        registry = mt.manager.registry
        registry.ready(registry.add(request, worker_id))

    mt.call(add)


# --------------------------------------------------------------------------- the fleet's JSON


def test_fleet_keeps_the_lifecycle_and_bounds_its_logs() -> None:
    with ManagerThread(chaos_manager_config(heartbeat_timeout_s=3600.0)) as mt:
        register_fake(mt, "a", usd_per_hour=0.5)
        register_fake(mt, "b")
        mt.publish_version(1)  # both go syncing: nobody delivers weights here
        mt.call(lambda: mt.manager.registry.heartbeat(mt.manager.registry.get("a"), _beat(1, 900.0)))
        mt.call(mt.manager.leave, "b", "spot notice")
        fleet = mt.call(fleet_status, mt.manager)
    assert [(e.worker_id, e.state) for e in fleet.events] == [
        ("a", "registering"),
        ("a", "active"),
        ("b", "registering"),
        ("b", "active"),
        ("a", "syncing"),
        ("b", "syncing"),
        ("a", "active"),
        ("b", "gone"),
    ]
    assert "spot notice" in fleet.events[-1].detail
    assert [(w.worker_id, w.state, w.weight_version, w.device) for w in fleet.workers] == [("a", "active", 1, "cpu")]
    assert fleet.workers[0].tokens_per_s == 900.0 and fleet.workers[0].usd_per_hour == 0.5
    assert fleet.latest_weight_version == 1 and fleet.num_lost_samples == 0
    FleetStatus.model_validate_json(fleet.model_dump_json())  # what it says can be read back
    from polyrl.manager.events import EventLog
    from polyrl.manager.fleet import History

    log, history = EventLog(maxlen=3), History(interval_s=0.0, maxlen=2)
    for i in range(5):
        log.add(f"w{i}", "active")
        history.maybe_sample([])
    assert [e.worker_id for e in log.events] == ["w2", "w3", "w4"] and len(history.points) == 2


def _beat(version: int, tokens_per_s: float):  # type: ignore[no-untyped-def]
    from polyrl.protocol.manager_api import Heartbeat

    return Heartbeat(state="active", weight_version=version, num_running=0, num_waiting=0, gen_throughput=tokens_per_s)


def test_the_autoscalers_decisions_reach_the_fleet_view_bounded_and_checked() -> None:
    """The trainer's link posts each decision; `GET /v1/fleet` keeps the latest, with the
    time they arrived; a malformed one is refused and changes nothing."""
    from polyrl.manager.fleet import MAX_DECISIONS

    with ManagerThread(chaos_manager_config(heartbeat_timeout_s=3600.0)) as mt:
        link = ManagerLink(mt.url, TOKEN, retry_s=1.0)
        t0 = time.time()
        for i in range(MAX_DECISIONS + 2):
            link.fleet_decision(FleetDecision(workers=i, target=i + 1, reason=f"step {i}: predicted"))
        with pytest.raises(Exception, match="422"):
            link._post("/v1/fleet/decisions", FleetDecision.model_construct(workers=-1, target=1, reason="x"))
        with pytest.raises(Exception, match="401"):
            ManagerLink(mt.url, "wrong", retry_s=1.0).fleet_decision(FleetDecision(workers=1, target=2, reason="x"))
        fleet = FleetStatus.model_validate_json(link.http.get("/v1/fleet").content)
        link.http.close()
    assert len(fleet.decisions) == MAX_DECISIONS
    assert [d.target for d in fleet.decisions[:2]] == [3, 4] and fleet.decisions[-1].reason == "step 101: predicted"
    assert all(d.t >= t0 for d in fleet.decisions)


def test_a_failed_batch_counts_its_lost_samples() -> None:
    with ManagerThread(chaos_manager_config()) as mt:  # no worker: the batch misses its deadline
        request = make_batch(2, 3, 4).model_copy(update={"deadline_s": 0.3})
        with pytest.raises(BatchError):
            list(mt.generate(request))
        assert mt.call(fleet_status, mt.manager).num_lost_samples == 6


# ------------------------------------------------------------------------------ polyrl status


def test_status_prints_the_workers_and_refuses_a_wrong_token() -> None:
    with ManagerThread(chaos_manager_config(heartbeat_timeout_s=3600.0)) as mt:
        register_fake(mt, "spot-a", usd_per_hour=0.42)
        register_fake(mt, "spot-b")
        out = io.StringIO()
        assert status(mt.url, TOKEN, console=Console(file=out, width=160)) == 0
        text = out.getvalue()
        for needle in ("spot-a", "spot-b", "active", "v0", "0.42", "127.0.0.1", "cpu", "2 workers", "lost 0"):
            assert needle in text, (needle, text)
        out = io.StringIO()
        assert status(mt.url, "wrong", console=Console(file=out, width=160)) == 1
        assert "refused the token" in out.getvalue() and "spot-a" not in out.getvalue()
        os.environ["POLYRL_TOKEN"] = TOKEN
        try:  # the command line: the token from the environment
            assert cli_main(["status", mt.url]) == 0
        finally:
            del os.environ["POLYRL_TOKEN"]


# ------------------------------------------------------------------------------ polyrl report


def _pixels_of(png: Path, rgb: tuple[float, ...]) -> int:
    """How many pixels of the image are within a few levels of `rgb` (a run's line)."""
    from matplotlib.image import imread

    image = (imread(png)[..., :3] * 255).round()  # [H, W, 3]
    return int((abs(image - rgb).max(axis=-1) <= 8).sum())


def _check_drawn(path: Path, num_runs: int) -> None:
    """The runs' colours cover far more than their legend handles would: lines across the
    plot are hundreds of pixels; an empty plot, or one of empty data, has a few dozen at
    most. (Together, not each: two runs' lines may lie on each other, e.g. both at 0.)"""
    colors = RUN_COLORS[:num_runs]
    if path.stem == "time_split":  # stacks colour by phase, at alpha 0.85 over white
        colors = (tuple(0.85 * c + 0.15 * 255 for c in RUN_COLORS[0]),)
    drawn = sum(_pixels_of(path, rgb) for rgb in colors)
    assert drawn > 500, (path.name, drawn)


def test_report_draws_two_real_runs_side_by_side(tmp_path: Path) -> None:
    paths = report([RUNS / "remote", RUNS / "colocated"], tmp_path / "out")
    names = {p.name for p in paths}
    expected = {f"{p.name}.png" for p in PANELS}
    assert names == expected | {"report.html"}  # these runs have every panel's keys
    for path in paths:
        data = path.read_bytes()
        assert len(data) > 5000, path
        if path.suffix == ".png":
            assert data.startswith(PNG)
            _check_drawn(path, num_runs=2)
    page = (tmp_path / "out" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(PANELS) and 'src="http' not in page
    assert "<td>remote</td><td>40</td>" in page and "<td>colocated</td><td>40</td>" in page


def test_report_draws_what_a_run_has_and_names_a_bad_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "partial"
    run.mkdir()
    rows = [json.loads(line) for line in (RUNS / "colocated" / "metrics.jsonl").read_text().splitlines()[:5]]
    lines = [json.dumps({k: v for k, v in row.items() if not k.startswith("cost/")}) for row in rows]  # no prices
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "critic/sc')  # torn last line
    paths = report([run], tmp_path / "out")
    assert "cost.png" not in {p.name for p in paths} and "reward.png" in {p.name for p in paths}
    _check_drawn(tmp_path / "out" / "reward.png", num_runs=1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "metrics.jsonl").write_text("")
    for bad, why in [("missing", "not a directory"), ("empty", "no metrics.jsonl"), ("blank", "no steps")]:
        with pytest.raises(ReportError, match=why):
            report([tmp_path / bad], tmp_path / "x")
        assert cli_main(["report", str(tmp_path / bad), "--out", str(tmp_path / "x")]) == 2
        assert why in capsys.readouterr().err


def test_report_reads_flat_panels_from_zero_with_whole_number_ticks() -> None:
    """The main job's fleet never changed: two workers all run long, nothing migrated or
    lost. Those panels start at 0 with whole-number ticks, the level on a tick, instead of
    1.900-2.100 and -0.04-0.04 around a line in the middle."""
    runs = load_runs([RUNS / "remote"])
    for name, level in (("workers", 2), ("migrations", 0), ("version_lag", 0)):
        fig = draw(next(p for p in PANELS if p.name == name), runs)
        assert fig is not None
        ax = fig.axes[0]
        low, high = ax.get_ylim()
        ticks = [t for t in ax.get_yticks() if low <= t <= high]
        assert -0.1 * high < low <= 0 and level < high < 1.5 * max(1, level), (name, low, high)
        assert all(t == round(t) for t in ticks) and 0 in ticks and level in ticks, (name, ticks)
    cost = draw(next(p for p in PANELS if p.name == "cost"), runs)  # $15.79/h all run long
    assert cost is not None and cost.axes[0].get_ylim()[0] <= 0


def test_report_keeps_identical_series_visible(tmp_path: Path) -> None:
    """Series that lie on each other all show. Two runs alike (the same run twice): each
    run's colour covers far more of every panel than its legend handle. One run's two
    equal keys (workers = rollout instances, same colour): different markers, at
    different steps."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        shutil.copyfile(RUNS / "remote" / "metrics.jsonl", tmp_path / name / "metrics.jsonl")
    report([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    for panel in PANELS:
        if panel.name != "time_split":  # one subplot per run: nothing to hide
            seen = [_pixels_of(tmp_path / "out" / f"{panel.name}.png", rgb) for rgb in RUN_COLORS]
            assert min(seen) > 200, (panel.name, seen)  # its legend handle alone: 44-72 pixels
    fig = draw(next(p for p in PANELS if p.name == "workers"), load_runs([RUNS / "remote"]))
    assert fig is not None
    lines = fig.axes[0].get_lines()
    assert len(lines) == 2 and list(lines[0].get_ydata()) == list(lines[1].get_ydata())
    assert lines[0].get_marker() != lines[1].get_marker() and "None" not in {line.get_marker() for line in lines}
    marked = [set(range(len(line.get_xdata()))[slice(*_start_stride(line.get_markevery()))]) for line in lines]
    assert marked[0] and marked[1] and not marked[0] & marked[1], marked


def _start_stride(markevery: object) -> tuple[int, None, int]:
    assert isinstance(markevery, tuple), markevery
    start, stride = markevery
    return start, None, stride


@pytest.mark.slow
def test_report_on_a_short_run_of_the_main_job(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The default main job (remote mode, two launched workers), three steps: its run
    directory is reported on as it is; the job logged the operator page's URL."""
    from polyrl.trainer.loop import train

    cfg = load_config(
        None,
        [
            "logging.console=false",
            "logging.tensorboard=false",
            "manager.port=0",
            "trainer.save_every=0",
            "fleet.ready_timeout_s=120",
            "trainer.total_steps=3",
        ],
    )
    with caplog.at_level(logging.INFO, logger="polyrl"):
        train(cfg, tmp_path / "run")
    pages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("operator page: http://127.0.0.1:")]
    assert len(pages) == 1 and "manager.json" in pages[0] and "polyrl status" in pages[0]
    assert cli_main(["report", str(tmp_path / "run")]) == 0
    out = tmp_path / "run" / "report"
    for name in ("reward", "throughput", "time_split", "workers", "cost", "tokens_per_usd", "logprob_diff", "report"):
        path = out / (f"{name}.html" if name == "report" else f"{name}.png")
        assert path.stat().st_size > 5000, path
        if path.suffix == ".png":
            _check_drawn(path, num_runs=1)


# ------------------------------------------------------------------------------ the live page


def test_page_renders_a_fleet_in_a_browser() -> None:
    """Fast: the page's script against a manager with two registered records."""
    binary = chromium()
    with ManagerThread(chaos_manager_config(heartbeat_timeout_s=3600.0)) as mt:
        register_fake(mt, "a", usd_per_hour=0.5)
        register_fake(mt, "b")
        before = dump_dom(binary, f"{mt.url}/?token={TOKEN}")
        link = ManagerLink(mt.url, TOKEN)
        link.fleet_decision(FleetDecision(workers=2, target=3, reason="tokens/$ 3,100,000 now, 3,400,000 predicted"))
        link.http.close()
        dom = dump_dom(binary, f"{mt.url}/?token={TOKEN}")
        refused = dump_dom(binary, f"{mt.url}/?token=wrong")
    assert "has not decided yet" in before and not re.search(r'data-target="\d', before)
    assert 'data-target="3"' in dom and "2 → 3" in dom and "3,400,000 predicted" in dom
    row_a, row_b = worker_row(dom, "a"), worker_row(dom, "b")
    assert row_a and 'data-state="active"' in row_a and "v0" in row_a and "0.50" in row_a
    assert row_b and '<td class="num">-</td>' in row_b  # no price: "-"
    assert 'data-worker="a" data-state="registering"' in dom
    assert "updated" in dom and "worker-a" not in refused and "<form" in refused


def test_page_says_a_wrong_token_was_refused() -> None:
    """A link with a wrong `?token=` gets the form again, and a notice that the token was
    refused (the same blank form alone looks as if the link had lost it); no token at all
    gets the form alone."""
    binary = chromium()
    with ManagerThread(chaos_manager_config(heartbeat_timeout_s=3600.0)) as mt:
        register_fake(mt, "a")
        refused = dump_dom(binary, f"{mt.url}/?token=not-the-token-42", budget_ms=500)
        blank = dump_dom(binary, f"{mt.url}/", budget_ms=500)
    notice = re.search(r'<p id="refused" role="alert"[^>]*>(.*?)</p>', refused, re.S)
    assert notice and "refused that token" in notice.group(1), refused
    assert "<form" in refused and "worker-a" not in refused and "not-the-token-42" not in refused
    assert "<form" in blank and 'id="refused"' not in blank


def test_an_idle_local_worker_shows_as_standby_not_syncing() -> None:
    """Remote mode: the trainer's own engine is synced only when the fleet needs it. While
    the workers serve version after version, the page, its timeline and `polyrl status`
    show it on standby at v0, not `syncing v0` with a syncing bar for the whole run."""
    binary = chromium()
    with ManagerThread(chaos_manager_config(heartbeat_timeout_s=3600.0)) as mt:
        register_fake(mt, "local", local=True)
        register_fake(mt, "a")
        registry = mt.manager.registry
        for version in (1, 2, 3):
            mt.publish_version(version)
            mt.call(lambda v=version: registry.heartbeat(registry.get("a"), _beat(v, 900.0)))
        dom = dump_dom(binary, f"{mt.url}/?token={TOKEN}")
        out = io.StringIO()
        assert status(mt.url, TOKEN, console=Console(file=out, width=160)) == 0
    row = worker_row(dom, "local")
    assert row and 'data-state="standby"' in row and ">standby<" in row and 'data-version="0"' in row, row
    assert 'data-state="active"' in (worker_row(dom, "a") or "")
    local_events = re.findall(r'<li data-worker="local" data-state="(\w+)">', dom)
    assert local_events == ["standby", "active", "registering"], local_events  # newest first
    assert "<title>local syncing" not in dom and "<title>local standby" in dom  # the timeline's bars
    local_line = next(line for line in out.getvalue().splitlines() if "(local)" in line)
    assert "standby" in local_line and "syncing" not in local_line, out.getvalue()


@pytest.fixture
def fleet_of_two(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[ManagerThread, dict[str, Worker]]]:
    cfg = chaos_manager_config(heartbeat_timeout_s=2.0)
    procs = {}
    with ManagerThread(cfg) as mt:
        try:
            for worker_id, price in [("spot-a", 0.35), ("spot-b", 0.42)]:
                log_file = open(tmp_path / f"{worker_id}.log", "wb")  # noqa: SIM115 - closed below
                procs[worker_id] = (
                    spawn_worker(
                        tiny_model_dir, mt.url, worker_id, free_port(), log_file, extra=[f"worker.usd_per_hour={price}"]
                    ),
                    log_file,
                )
            wait_for(lambda: active_ids(mt) == {"spot-a", "spot-b"}, 120, "two active workers")
            yield mt, {k: p for k, (p, _) in procs.items()}
        finally:
            for proc, log_file in procs.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=30)
                log_file.close()


def _traffic(mt: ManagerThread, stop: threading.Event) -> None:
    """Batches until `stop`, so the workers report tokens/s (and the chart has a curve)."""
    i = 0
    while not stop.is_set():
        try:
            list(mt.generate(make_batch(4, 4, 48, tag=f"t{i}-")))
        except BatchError:
            return
        i += 1


@pytest.mark.slow
def test_page_shows_two_real_workers_then_one_gone_after_kill_9(
    fleet_of_two: tuple[ManagerThread, dict[str, Worker]], tmp_path: Path
) -> None:
    """Two `polyrl worker` processes under load; one is killed with -9 mid-traffic (its
    samples migrate). The page lists both with their version, price, pid and log file, then only the
    survivor, with the kill on the timeline. The screenshot is README's
    (POLYRL_UPDATE_DOCS=1 refreshes docs/operator-page.png)."""
    binary = chromium()
    mt, procs = fleet_of_two
    url = f"{mt.url}/?token={TOKEN}"
    stop = threading.Event()
    traffic = threading.Thread(target=_traffic, args=(mt, stop), daemon=True)
    traffic.start()
    try:
        wait_for(lambda: all(w.gen_throughput > 0 for w in mt.worker_list().workers), 30, "workers reporting tokens/s")
        dom = dump_dom(binary, url)
        for worker_id, price in (("spot-a", "0.35"), ("spot-b", "0.42")):
            row = worker_row(dom, worker_id)
            assert row and 'data-state="active"' in row and 'data-version="0"' in row and ">v0<" in row, row
            assert f">{price}<" in row
            # where an operator finds the process: its pid and its log file (issue 38)
            assert f"pid {procs[worker_id].pid}" in row and str(tmp_path / f"{worker_id}.log") in row, row

        procs["spot-b"].kill()  # kill -9, no notice
        wait_for(lambda: "spot-b" not in {w.worker_id for w in mt.worker_list().workers}, 30, "the manager noticing")
        time.sleep(2.5)  # a history point after the kill
        dom = dump_dom(binary, url)
        shot = tmp_path / "operator-page.png"
        screenshot(binary, url, shot, size=(1400, 900))
    finally:
        stop.set()
        traffic.join(timeout=60)
    assert worker_row(dom, "spot-b") is None, "a dead worker is still listed"
    assert worker_row(dom, "spot-a") is not None
    assert re.search(r"<li data-worker=\"spot-b\" data-state=\"gone\">[^<]*<b>spot-b</b> gone", dom), dom[-3000:]
    assert "<polyline" in dom  # the throughput chart has a curve
    assert shot.read_bytes().startswith(PNG) and shot.stat().st_size > 20_000
    if os.environ.get("POLYRL_UPDATE_DOCS"):
        DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOCS_SCREENSHOT)
