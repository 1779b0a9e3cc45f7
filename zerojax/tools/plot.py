"""`zerojax plot RUN_DIR...`: loss, lr, gradient norm and throughput of runs, overlaid in one PNG, and a
panel for each further scalar series a run logged (an RLHF loop's reward and KL).

Reads each run's metrics.jsonl (what the Monitor writes at every log step), so a run can be looked
at while it trains or long after; matplotlib is imported only here (`pip install zerojax[plot]`) and
draws off-screen (Agg), so no display is needed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from zerojax.errors import ConfigError

#: (metrics.jsonl key, panel title, log scale)
PANELS = (("loss", "training loss", False), ("lr", "learning rate", False),
          ("grad_norm", "gradient norm", True), ("tokens_per_s", "throughput (tokens/s)", False))
#: metrics.jsonl keys that get no panel of their own
NOT_DRAWN = ("step", "loss_scale", "skipped")
#: titles of known extra series (others are titled by their key)
TITLES = {"reward": "reward", "kl": "KL to the reference policy", "val_loss": "validation loss (run.eval_every)"}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (a run folder, or the file itself), in step order."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"plot: {path} does not exist; give the folder of a run (its run.output_dir, "
                          f"which holds metrics.jsonl)")
    rows, lines = [], path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):  # a run still writing: its last line may be partial
                break
            raise ConfigError(f"plot: {path} line {n} is not JSON") from None
    if not rows:
        raise ConfigError(f"plot: {path} has no rows yet; the run writes one every run.log_every steps")
    return sorted(rows, key=lambda r: r.get("step", 0))


def _label(run_dir: Path) -> str:
    """The run's folder name, with its ZeRO stage when config.json says it."""
    run_dir = run_dir if run_dir.is_dir() else run_dir.parent
    try:
        stage = json.loads((run_dir / "config.json").read_text())["zero_optimization"]["stage"]
    except (OSError, KeyError, TypeError, ValueError):
        return run_dir.name
    return f"{run_dir.name} (ZeRO-{stage})"


def extra_panels(runs: Sequence[list[dict[str, Any]]]) -> list[tuple[str, str, bool]]:
    """A panel for every numeric key some run logged beyond the four standard ones, in first-seen order."""
    known = {key for key, _, _ in PANELS} | set(NOT_DRAWN)
    keys: dict[str, None] = {}
    for rows in runs:
        for row in rows:
            keys.update({k: None for k, v in row.items()
                         if k not in known and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return [(k, TITLES.get(k, k), False) for k in keys]


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, title: str | None = None) -> Path:
    """One figure, four panels (loss, lr, grad norm, tokens/s against step) and one per extra series
    (`extra_panels`), every run overlaid."""
    if not run_dirs:
        raise ConfigError("plot: give at least one run folder")
    runs = [(_label(Path(d)), read_metrics(d)) for d in run_dirs]  # every error before drawing
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plot: needs matplotlib; pip install 'zerojax[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [*PANELS, *extra_panels([rows for _, rows in runs])]
    cols = 2 if len(panels) <= 4 else 3
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 3.75 * nrows), constrained_layout=True, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (key, name, log) in zip(axes.flat, panels):
        drawn = False
        for label, rows in runs:
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if key == "tokens_per_s":
                points = points[1:] or points  # the first interval includes compilation
            if points:
                ax.plot(*zip(*points), label=label, marker="." if len(points) < 30 else None)
                drawn = True
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if log and drawn:
            ax.set_yscale("log")
        if not drawn:
            ax.text(0.5, 0.5, f"no {key} in metrics.jsonl", ha="center", va="center", transform=ax.transAxes)
    axes.flat[0].legend(fontsize="small")
    fig.suptitle(title or ", ".join(label for label, _ in runs), fontsize="medium")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
