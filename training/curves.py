"""`curves`: several training runs' held-out learning curves side by side (one JSON, one PNG).

Design and loss comparisons are decided by curves at equal budget: this puts each run's
held-out expected and greedy accepted length against CPU hours and tokens seen into one JSON
(with the date, machine and command) and draws them on shared axes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vllm_specdiff.provenance import provenance

from .export import learning_curve, plot_learning_curve
from .trainer import LOG_FILE


@dataclass
class CurvesConfig:
    runs: list[str] = field(default_factory=list)  # `train` output directories
    output: str = "curves.json"


def run_curves(cfg: CurvesConfig) -> dict:
    if not cfg.runs:
        raise ValueError("--runs names no training run")
    runs = {}
    for run in map(Path, cfg.runs):
        if not (run / LOG_FILE).is_file():
            raise FileNotFoundError(f"--runs {run}: no {LOG_FILE} (not a `train` output)")
        config = json.loads((run / "train_config.json").read_text())
        runs[run.name] = {"train_config": config,
                          "curve": learning_curve(run, up_to_step=10**12)}
    out = Path(cfg.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"provenance": provenance(), "runs": runs}
    out.write_text(json.dumps(report, indent=2) + "\n")
    merged = [point for r in runs.values() for point in r["curve"]]
    plot = plot_learning_curve(merged, out.with_suffix(".png"), "held-out")
    return {"output": str(out), "plot": str(plot),
            "last": {name: r["curve"][-1] if r["curve"] else None for name, r in runs.items()}}
