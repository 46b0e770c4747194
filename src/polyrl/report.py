"""`polyrl report RUN_DIR [RUN_DIR ...] --out DIR`: plots of runs from their `metrics.jsonl`.

One PNG per panel (reward and its spread, response length, throughput, the step's time
split, workers, cost, tokens per dollar, `rollout/logprob_diff`, version lag, migrated
samples) and `report.html`, which inlines them, so the report travels as one file. A
panel is drawn when any run has one of its keys: a colocated run has no cost, an old
run may lack a newer key. Several runs share each panel's axes, one colour per run, so
colocated against hybrid reads at a glance.

Many series are flat: two workers all run long, zero samples lost. A non-negative panel's
y-axis starts at 0, so a flat series reads as its level (matplotlib would centre it in
1.900-2.100, or -0.04-0.04 for zeros), and counts get whole-number ticks. Flat series also
lie on each other (both runs lost nothing; workers = rollout instances): with several
lines in a panel, each gets its own marker shape, the lines' markers at different steps,
so one drawn over another still shows.

Figures are built with matplotlib's object API on the Agg canvas (no pyplot): no
display, no global figure state.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P")
MARKS_PER_LINE = 10


class ReportError(Exception):
    """A run directory that cannot be reported on; the message names it and why."""


@dataclass(frozen=True)
class Panel:
    name: str
    title: str
    keys: tuple[str, ...]
    ylabel: str
    band: tuple[str, str] | None = None
    """(low, high) keys drawn as a shaded spread around the first key."""
    log_y: bool = False
    is_count: bool = False
    """Whole numbers (workers, samples, versions): ticks at integers."""


PANELS = (
    Panel(
        "reward",
        "Reward (mean; shaded: min to max)",
        ("critic/score/mean",),
        "score",
        band=("critic/score/min", "critic/score/max"),
    ),
    Panel(
        "response_length",
        "Response length (mean; shaded: min to max)",
        ("response_length/mean",),
        "tokens",
        band=("response_length/min", "response_length/max"),
    ),
    Panel("throughput", "Throughput", ("perf/throughput", "perf/tokens_per_s_per_worker"), "tokens/s"),
    Panel("time_split", "Time per step, by phase", ("perf/time_per_step",), "seconds"),
    Panel(
        "workers",
        "Rollout workers",
        ("training/num_workers", "training/num_rollout_instances"),
        "workers",
        is_count=True,
    ),
    Panel("cost", "Cost", ("cost/usd_per_hour",), "$/h"),
    Panel("tokens_per_usd", "Tokens per dollar", ("cost/tokens_per_usd",), "tokens/$"),
    Panel(
        "logprob_diff", "rollout/logprob_diff (engine vs learner)", ("rollout/logprob_diff",), "mean |diff|", log_y=True
    ),
    Panel(
        "version_lag",
        "Weight-version lag of the samples",
        ("rollout/version_lag/mean", "rollout/version_lag/max"),
        "versions",
        is_count=True,
    ),
    Panel(
        "migrations",
        "Samples migrated / lost",
        ("rollout/migrated_samples", "rollout/samples_lost"),
        "samples",
        is_count=True,
    ),
)


@dataclass
class Run:
    name: str
    rows: list[dict[str, float]]

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of the rows that have `key` as a finite number."""
        pairs = [(r["step"], r[key]) for r in self.rows if _is_number(r.get(key))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def has(self, key: str) -> bool:
        return any(_is_number(r.get(key)) for r in self.rows)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def load_run(run_dir: Path) -> list[dict[str, float]]:
    """The run's steps in order; a torn last line (a crash mid-write) is skipped."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: not a directory")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{run_dir}: no metrics.jsonl (not a run directory, or the run wrote no step yet)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and _is_number(row.get("step")):
            rows.append(row)
    if not rows:
        raise ReportError(f"{path}: no steps in it")
    return sorted(rows, key=lambda r: r["step"])


def load_runs(run_dirs: list[Path]) -> list[Run]:
    names = [d.resolve().name for d in run_dirs]
    if len(set(names)) < len(names):  # runs/a/run and runs/b/run: tell them apart
        names = [str(d) for d in run_dirs]
    return [Run(name, load_run(d)) for name, d in zip(names, run_dirs, strict=True)]


PHASES = ("timing_s/gen", "timing_s/reward", "timing_s/update_actor", "timing_s/update_weights")
"""Where a step's time goes (trainer/loop.py's timer spans); the rest of the step is `other`."""


def draw_time_split(runs: list[Run]) -> Figure | None:
    """Stacked phases per step and the step's wall time, one subplot per run side by side
    (stacks do not share axes). A stack above the wall time means phases overlapped."""
    runs = [run for run in runs if run.has("perf/time_per_step")]
    if not runs:
        return None
    fig = Figure(figsize=(min(15.0, 4.5 * len(runs) + 2.5), 3.8), layout="constrained")
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    for ax, run in zip(axes, runs, strict=True):
        rows = [r for r in run.rows if _is_number(r.get("perf/time_per_step"))]
        steps = [r["step"] for r in rows]
        layers = {
            k.removeprefix("timing_s/"): [r.get(k, 0.0) if _is_number(r.get(k)) else 0.0 for r in rows]
            for k in PHASES
            if run.has(k)
        }
        phases = list(layers.values())
        layers["other"] = [max(0.0, r["perf/time_per_step"] - sum(v[i] for v in phases)) for i, r in enumerate(rows)]
        ax.stackplot(steps, *layers.values(), labels=list(layers), alpha=0.85)
        # the phases overlap where generation runs beside the learner: the wall time shows it
        ax.plot(steps, [r["perf/time_per_step"] for r in rows], color="black", linewidth=1.2, label="step (wall)")
        ax.set_title(run.name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("seconds")
    axes[-1].legend(fontsize=8, loc="upper right")
    fig.suptitle("Time per step, by phase", fontsize=11)
    return fig


def draw(panel: Panel, runs: list[Run]) -> Figure | None:
    """The panel with every run on the same axes; None when no run has its keys."""
    if panel.name == "time_split":
        return draw_time_split(runs)
    keys = [k for k in panel.keys if any(run.has(k) for run in runs)]
    if not keys:
        return None
    fig = Figure(figsize=(7.5, 3.8), layout="constrained")
    ax = fig.subplots()
    num_lines = sum(run.has(k) for run in runs for k in keys)
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        if panel.band is not None and run.has(panel.band[0]) and run.has(panel.band[1]):
            steps, low = run.series(panel.band[0])
            steps_high, high = run.series(panel.band[1])
            if steps == steps_high:
                ax.fill_between(steps, low, high, color=color, alpha=0.18, linewidth=0)
        for j, key in enumerate(keys):
            steps, values = run.series(key)
            if steps:
                label = run.name if len(keys) == 1 else f"{run.name}: {key}"
                style = LINESTYLES[j % len(LINESTYLES)]
                marks = _marks(len(ax.lines), num_lines, len(steps))
                ax.plot(steps, values, color=color, linestyle=style, label=label, linewidth=1.4, **marks)
    ax.set_title(panel.title, fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    if panel.log_y and all(v > 0 for run in runs for k in keys for v in run.series(k)[1]):
        ax.set_yscale("log")
    else:
        _from_zero(ax, panel.is_count)
    ax.grid(alpha=0.3)
    if len(runs) > 1 or len(keys) > 1:
        ax.legend(fontsize=8)
    return fig


def _marks(index: int, num_lines: int, num_points: int) -> dict[str, object]:
    """Line `index` of `num_lines`: its marker shape, at about MARKS_PER_LINE of its points,
    offset from the other lines' markers so that lines lying on each other all show."""
    if num_lines < 2:
        return {}
    stride = max(num_lines, -(-num_points // MARKS_PER_LINE))
    return {
        "marker": MARKERS[index % len(MARKERS)],
        "markersize": 5,
        "markevery": (index * stride // num_lines, stride),
    }


def _from_zero(ax: Axes, is_count: bool) -> None:
    """A non-negative panel's y-axis from 0 (a hair below, so a line at 0 is not cut by
    the frame), at least 0-1 when everything is 0; counts get whole-number ticks."""
    low, high = ax.dataLim.y0, ax.dataLim.y1
    if not math.isfinite(low) or low < 0:
        return
    top = high * 1.08 if high > 0 else 1.0
    ax.set_ylim(-0.03 * top, top)
    if is_count:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _summary(run: Run) -> list[str]:
    def mean_of(key: str, tail: float = 1.0) -> str:
        values = run.series(key)[1]
        values = values[-max(1, int(len(values) * tail)) :]
        return f"{sum(values) / len(values):,.4g}" if values else "-"

    return [
        run.name,
        str(len(run.rows)),
        mean_of("critic/score/mean", 0.1),
        mean_of("perf/throughput"),
        mean_of("perf/time_per_step"),
        mean_of("cost/tokens_per_usd"),
    ]


def write_html(out: Path, runs: list[Run], images: dict[Panel, Path]) -> Path:
    head = ["run", "steps", "reward (last 10%)", "tokens/s", "s/step", "tokens/$"]
    table = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    for run in runs:
        table += "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _summary(run)) + "</tr>"
    body = "".join(
        f'<h2>{html.escape(panel.title)}</h2><img alt="{panel.name}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}">'
        for panel, path in images.items()
    )
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>polyrl report</title>'
        "<style>body{font:14px system-ui,sans-serif;margin:24px;max-width:900px}img{max-width:100%}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "td:first-child{text-align:left}</style></head><body>"
        f"<h1>polyrl report</h1><table><tr>{table}</tr></table>{body}</body></html>"
    )
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def report(run_dirs: list[Path], out: Path) -> list[Path]:
    """Write the panels' PNGs and report.html into `out`; returns their paths."""
    if not run_dirs:
        raise ReportError("no run directory given")
    runs = load_runs(run_dirs)
    out.mkdir(parents=True, exist_ok=True)
    images: dict[Panel, Path] = {}
    for panel in PANELS:
        fig = draw(panel, runs)
        if fig is not None:
            images[panel] = out / f"{panel.name}.png"
            fig.savefig(images[panel], dpi=100)
    return [*images.values(), write_html(out, runs, images)]
