"""PNG figures of a suite result (matplotlib, Agg backend): written only where the run has
the data (e.g. the K plot needs two K values of SpecDiff-2)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plots needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _methods(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["label"]: m for m in result["suite"]["methods"]}


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def speedup_by_method(result: dict[str, Any], plt: Any, path: Path) -> bool:
    """Bars of speedup per method and prompt set, one panel per (temperature, batch size)."""
    cells = result["cells"]
    temps = sorted({c["temperature"] for c in cells})
    batches = sorted({c["batch_size"] for c in cells})
    sets = list(dict.fromkeys(c["prompts"] for c in cells))
    labels = [m for m in _methods(result) if _methods(result)[m]["kind"] != "plain"]
    if not labels:
        return False
    fig, axes = plt.subplots(len(temps), len(batches), squeeze=False,
                             figsize=(4 * len(batches) + 2, 3 * len(temps) + 1))
    width = 0.8 / len(labels)
    for (ti, temp), (bi, batch) in ((t, b) for t in enumerate(temps) for b in enumerate(batches)):
        ax = axes[ti][bi]
        for mi, label in enumerate(labels):
            ys = [next((c["speedup"] or 0.0 for c in cells if c["prompts"] == s
                        and c["method"] == label and c["temperature"] == temp
                        and c["batch_size"] == batch), 0.0) for s in sets]
            ax.bar([i + mi * width for i in range(len(sets))], ys, width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sets))], sets, fontsize=7)
        ax.set_title(f"T={temp:g}, batch {batch}", fontsize=9)
        ax.set_ylabel("speedup vs plain")
    axes[0][-1].legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def acceptance_curves(result: dict[str, Any], plt: Any, path: Path) -> bool:
    """Per-position acceptance (P(position i accepted)) per method at the smallest batch,
    pooled over prompt sets (the paper's Figure 2); one panel per temperature."""
    cells = [c for c in result["cells"] if c.get("per_position_acceptance")]
    if not cells:
        return False
    batch = min(c["batch_size"] for c in cells)
    temps = sorted({c["temperature"] for c in cells})
    fig, axes = plt.subplots(1, len(temps), squeeze=False, figsize=(5 * len(temps), 3.5))
    for ti, temp in enumerate(temps):
        ax = axes[0][ti]
        curves: dict[str, list[list[float]]] = defaultdict(list)
        for c in cells:
            if c["temperature"] == temp and c["batch_size"] == batch:
                curves[c["method"]].append(c["per_position_acceptance"])
        for label, rows in curves.items():
            mean = [_mean(list(col)) for col in zip(*rows, strict=False)]
            ax.plot(range(1, len(mean) + 1), mean, marker="o", label=label)
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
        ax.set_title(f"T={temp:g}, batch {batch}", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _series(result: dict[str, Any], key: str, group: Any,
            min_points: int = 2) -> dict[Any, dict[float, float]]:
    """speedup (mean over prompt sets and temperature 0 cells, smallest batch) against the
    method option `key`, one series per `group(method)` (None: not in the sweep)."""
    methods = _methods(result)
    cells = [c for c in result["cells"] if c["temperature"] == min(
        x["temperature"] for x in result["cells"])]
    batch = min(c["batch_size"] for c in cells)
    points: dict[Any, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in cells:
        method = methods[c["method"]]
        name = group(method)
        if name is None or c["batch_size"] != batch or c["speedup"] is None:
            continue
        x = method["gamma"] if key == "gamma" else method["options"].get(key, 1)
        points[name][x].append(c["speedup"])
    return {name: {x: _mean(v) for x, v in sorted(p.items())} for name, p in points.items()
            if len(p) >= min_points}


def _line_plot(series: dict[Any, dict[float, float]], plt: Any, path: Path,
               xlabel: str, legend: str) -> bool:
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, points in series.items():
        ax.plot(list(points), list(points.values()), marker="o", label=f"{legend}{name}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speedup vs plain")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _family(method: dict[str, Any], *sweep: str) -> str | None:
    """The method without the swept settings: methods of one family differ only in them."""
    if method["kind"] == "plain":
        return None
    rest = {k: v for k, v in method["options"].items() if k not in sweep}
    if "gamma" not in sweep:
        rest["gamma"] = method["gamma"]
    return f"{method['name']} {rest}"


def speedup_vs_k(result: dict[str, Any], plt: Any, path: Path) -> bool:
    """Speedup against K, one line per drafter temperature (the paper's Figure 5). K = 1
    drafts the argmax whatever T_d is, so its point starts every line of its family."""
    def family(m: dict[str, Any]) -> str:
        rest = {k: v for k, v in m["options"].items()
                if k not in ("num_drafts", "drafter_temperature", "candidates")}
        return f"specdiff2 {rest | {'gamma': m['gamma']}}"

    def group(m: dict[str, Any]) -> tuple[str, float] | None:
        if m["kind"] != "specdiff":
            return None
        return family(m), float(m["options"].get("drafter_temperature", 0))

    series = _series(result, "num_drafts", group, min_points=1)
    k1 = {fam: points[1] for (fam, _), points in series.items() if 1 in points}
    lines = {}
    for (fam, t_d), points in series.items():
        start = {1: k1[fam]} if fam in k1 and 1 not in points else {}
        merged = dict(sorted({**start, **points}.items()))
        if len(merged) > 1 and set(points) != {1}:
            lines[f"{fam}, T_d={t_d:g}"] = merged
    return _line_plot(lines, plt, path, "K (candidate drafts)", "")


def sweep(result: dict[str, Any], key: str, plt: Any, path: Path) -> bool:
    """Speedup against one setting (gamma, steps), one line per method family."""
    return _line_plot(_series(result, key, lambda m: _family(m, key)), plt, path, key, "")


def write_plots(result: dict[str, Any], folder: str | Path) -> list[str]:
    """Every figure the result has data for; returns the files written."""
    plt = pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    figures = {
        "speedup_by_method.png": lambda p: speedup_by_method(result, plt, p),
        "acceptance_per_position.png": lambda p: acceptance_curves(result, plt, p),
        "speedup_vs_k.png": lambda p: speedup_vs_k(result, plt, p),
        "gamma_sweep.png": lambda p: sweep(result, "gamma", plt, p),
        "steps_sweep.png": lambda p: sweep(result, "steps", plt, p),
    }
    return [str(folder / name) for name, draw in figures.items() if draw(folder / name)]
