"""`specdiff-distill recipe run`: the stages of a recipe in order, each once.

The run's stages: `generate:PACK` for each new pack that is not committed (one that no stage,
evaluation or subset reads only with `--only generate:PACK`), `data` (committed packs and
subsets), `features`, one per [[stages]] table (by its name), `eval` and `export`. A stage that
finished with the same settings (its record in WORK/stages/) is skipped; one that did not runs,
and the step it calls keeps what exists (prompt files, shards, feature shards, the latest
checkpoint). `--from-stage` and `--only` pick stages by name. The run ends with a summary: per
stage done / skipped, seconds and outputs (also WORK/summary.json).

Under torchrun (`torchrun --nproc-per-node N -m vllm_specdiff_training.cli recipe run ...`) the
features and every training stage run on every process (the features split by shard, training
DDP through accelerate); the other stages, the exports of the training stages and every record
and summary run on rank 0 only, and after each stage the other ranks wait for rank 0's record.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..features import launched_rank
from . import packs as P
from . import stages as S
from .schema import NEW_PACK_STAGE, load_recipe
from .smoke import smoke_recipe
from .workspace import Workspace, digest

log = logging.getLogger(__name__)


@dataclass
class Step:
    name: str
    settings: Any  # what decides its outputs: changed, the stage runs again
    action: Callable[[], dict]
    wanted: bool = True  # false: run only when --only names it (a pack nothing reads)
    every_rank: bool = False  # under torchrun: run by every process (else by rank 0 only)


def plan(ws: Workspace) -> list[Step]:
    """Every stage of the recipe, in the order they run."""
    r = ws.recipe
    steps: list[Step] = []
    read = r.packs_read()
    for table, pack in r.packs_to_make():
        settings = {"table": table, "pack": dataclasses.asdict(pack),
                    "generate": r.generate_settings(pack), "packed": r.generate.pack,
                    "earlier": [dataclasses.asdict(p) for p in P.earlier_corpora(r, pack)]
                    if table == "corpus" else []}
        steps.append(Step(NEW_PACK_STAGE + pack.name, settings,
                          functools.partial(P.make_pack, ws, table, pack),
                          wanted=pack.name in read))
    if r.committed_packs() or r.data.subsets:
        steps.append(Step("data", {"packs": r.committed_packs(),
                                   "packs_dir": r.resolve(r.data.packs_dir),
                                   "subsets": [dataclasses.asdict(s) for s in r.data.subsets]},
                          functools.partial(P.unpack_data, ws)))
    used = list(dict.fromkeys([p for s in r.stages for p in s.packs]
                              + [p for e in r.eval for p in e.packs]))
    if r.drafter.conditioned:  # the other drafters read no verifier features
        steps.append(Step("features", {"packs": used, "taps": r.drafter.taps},
                          functools.partial(S.build_pack_features, ws, used), every_rank=True))
    keys: dict[str, str] = {}  # a stage's key covers the stage it starts from
    for stage in r.stages:
        settings = {"train": dataclasses.asdict(S.train_config(ws, stage)),
                    "threads": stage.threads, "start": keys.get(stage.start)}
        keys[stage.name] = digest(settings)
        steps.append(Step(stage.name, settings, functools.partial(S.train_stage, ws, stage),
                          every_rank=True))
    final = keys[r.final_stage().name]
    if r.eval:
        steps.append(Step("eval", {"eval": [dataclasses.asdict(e) for e in r.eval],
                                   "generate": dataclasses.asdict(r.generate), "stage": final},
                          functools.partial(S.evaluate, ws)))
    steps.append(Step("export", {"export": dataclasses.asdict(r.export), "stage": final},
                      functools.partial(S.export, ws)))
    return steps


def select(steps: list[Step], from_stage: str | None, only: str | None) -> list[Step]:
    names = [s.name for s in steps]
    for option, value in (("--from-stage", from_stage), ("--only", only)):
        if value is not None and value not in names:
            raise ValueError(f"{option} {value}: no such stage; this recipe's stages are "
                             f"{', '.join(names)}")
    if only is not None:
        return [s for s in steps if s.name == only]
    kept = steps[names.index(from_stage):] if from_stage is not None else steps
    return [s for s in kept if s.wanted]


def meet_ranks() -> None:
    """Under torchrun, every rank at once before a stage they run together (the process group
    training uses), so that none starts it while another still waits for rank 0's record of
    the stage before."""
    import torch
    from accelerate import PartialState

    PartialState(cpu=not torch.cuda.is_available()).wait_for_everyone()


def run_recipe(path: str | Path, smoke: bool = False, from_stage: str | None = None,
               only: str | None = None) -> dict:
    """Run (or resume) a recipe; returns the summary."""
    recipe = load_recipe(path)
    if smoke:
        recipe = smoke_recipe(recipe)
    ws = Workspace.open(recipe, smoke)
    steps = select(plan(ws), from_stage, only)
    rank, world = launched_rank()
    lead = rank == 0  # under torchrun, the process that runs the one-process stages and records
    if lead:
        ws.root.mkdir(parents=True, exist_ok=True)
        (ws.root / "recipe.toml").write_text(Path(path).read_text())
    else:
        log.info("rank %d of %d: runs the features and training stages with rank 0, waits for "
                 "its records of the others", rank, world)
    rows: list[dict] = []
    summary = {"recipe": recipe.name, "work_dir": str(ws.root), "smoke": smoke, "stages": rows}
    try:
        for i, step in enumerate(steps, 1):
            key = digest(step.settings)
            record = ws.done(step.name, key)
            if record is not None:
                if lead:
                    log.info("[%d/%d] %s: done before, skipped", i, len(steps), step.name)
                rows.append({"stage": step.name, "status": "skipped", "seconds": 0.0,
                             "outputs": record["outputs"]})
                continue
            if lead:
                log.info("[%d/%d] %s", i, len(steps), step.name)
            start = time.perf_counter()
            rows.append({"stage": step.name, "status": "failed", "seconds": 0.0, "outputs": {}})
            if step.every_rank and world > 1:
                meet_ranks()
            outputs = step.action() if lead or step.every_rank else {}
            seconds = round(time.perf_counter() - start, 1)
            if lead:
                ws.write_record(step.name, key, outputs, seconds)
            else:  # what rank 0 made of the stage, before the next one reads it
                outputs = ws.wait_for_record(step.name, key)["outputs"]
            rows[-1].update(status="done", seconds=seconds, outputs=outputs)
    finally:
        if lead:
            (ws.root / "summary.json").write_text(json.dumps(summary, indent=2, default=str)
                                                  + "\n")
    return summary


def format_summary(summary: dict) -> str:
    """The summary as a table: stage, done / skipped, seconds, outputs."""
    rows = [("stage", "status", "seconds", "outputs")]
    for r in summary["stages"]:
        outputs = json.dumps(r["outputs"], default=str)
        rows.append((r["stage"], r["status"], f"{r['seconds']:.1f}",
                     outputs if len(outputs) <= 100 else outputs[:97] + "..."))
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"recipe {summary['recipe']}{' (smoke)' if summary['smoke'] else ''}: "
             f"{summary['work_dir']}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row[:3], width, strict=True)) + "  " + row[3]
              for row in rows]
    return "\n".join(lines)
