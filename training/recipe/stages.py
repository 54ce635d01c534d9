"""What each stage of a recipe does: a call of the step that already exists for it.

The data stages (committed packs, subsets, new packs) are in packs.py; here: features:
`build_features`; a training stage: `run_train` (which resumes from its latest checkpoint) and
`run_export` of its last checkpoint; eval: `run_eval`; export: `export_dflash`; and the prompt
files both sides write. Each is resumable by the step it calls (shards, feature shards and
checkpoints that exist are kept).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..features import launched_rank
from ..generate import GenerateConfig, run_generate
from ..trainer import CKPT_DIR, TrainConfig
from .schema import EVAL_FIELDS, TRAIN_FIELDS, VERIFIER_START
from .workspace import Workspace

log = logging.getLogger(__name__)

# what an evaluation reports per set (those its settings measured)
HEADLINE = ("replay_accepted_per_step", "data_greedy_accepted_length", "verifier_token_streak",
            "greedy_accepted_length", "expected_accepted_length", "windows")


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """The stage's CPU threads (the script's OMP_NUM_THREADS), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def verifier_threads(fn: Callable[..., dict]) -> Callable[..., dict]:
    """Run a stage of verifier forwards (generation, features, evaluation) with the recipe's
    generate.threads."""
    @functools.wraps(fn)
    def run(ws: Workspace, *args: Any) -> dict:
        with threads(ws.recipe.generate.threads):
            return fn(ws, *args)
    return run


def _fields(obj: Any, names: Any) -> dict[str, Any]:
    return {n: getattr(obj, n) for n in names}


def write_prompts(path: Path, settings: dict[str, Any], make: Callable[[Path], Any],
                  partial: bool = True) -> None:
    """A prompt file written once by `make(out)`, its settings beside it: a rerun keeps it, and
    one with other settings is refused rather than continued from the wrong prompts. With
    `partial`, `make` writes a partial file that takes the name when done (a crash leaves no
    half file that a rerun would take for finished)."""
    record = path.with_suffix(".settings.json")
    text = json.dumps(settings, sort_keys=True, default=str)
    if path.is_file():
        if record.is_file() and record.read_text() != text:
            raise ValueError(f"{path} was written with other settings than the recipe's now "
                             f"(see {record.name}); delete it and its data to make it again")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if partial:
        tmp = path.with_name(path.name + ".partial.jsonl")
        make(tmp)
        tmp.replace(path)
    else:
        make(path)
    record.write_text(text)


def source_prompts(path: Path, source: str, limit: int | None) -> Path:
    """A prompt source as a prompt file: a .jsonl's records as they are (their `source` decides
    decontamination), a built-in set as chat messages."""
    from vllm_specdiff.prompts import load_prompts, read_jsonl

    def write(out: Path) -> None:
        records = read_jsonl(source)[:limit] if source.endswith(".jsonl") else \
            [{"messages": m} for m in load_prompts(source, limit)]
        out.write_text("".join(json.dumps(r) + "\n" for r in records))

    write_prompts(path, {"source": source, "max_prompts": limit}, write)
    return path


@verifier_threads
def build_pack_features(ws: Workspace, packs: list[str]) -> dict:
    """The verifier features of every pack a stage or evaluation reads, ahead of training."""
    from ..features import build_features

    taps = tuple(ws.recipe.drafter.taps)
    device = rank_device(ws.recipe.generate.device)
    return {"packs": packs, "taps": list(taps),
            "shards_built": build_features(ws.data_arg(packs), ws.verifier, taps, device)}


def rank_device(device: str) -> str:
    """The recipe's generate.device for this process's verifier forwards: `auto` is the GPU
    where there is one (the verifier in bf16 there), and under torchrun each process takes the
    GPU of its LOCAL_RANK."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if device == "cuda" else device


# ---- training -----------------------------------------------------------------------------------
def train_config(ws: Workspace, stage: Any) -> TrainConfig:
    """`specdiff-distill train` of a recipe stage."""
    r = ws.recipe
    if stage.start == VERIFIER_START:  # a block-causal drafter's head is reduced at export
        start: dict[str, Any] = {"draft_vocab_size": r.drafter.draft_vocab_size
                                 if r.drafter.conditioned else None}
    elif "/" in stage.start:
        start = {"drafter": r.resolve(stage.start)}
    else:
        earlier = {s.name: s for s in r.stages}[stage.start]
        start = {"drafter": str(ws.stage_drafter(earlier))}
    # a conditioned drafter always reads the verifier; a block-causal one is built from it once
    verifier = ws.verifier if r.drafter.conditioned or "drafter" not in start else None
    return TrainConfig(data=ws.data_arg(stage.packs), output=str(ws.run_dir(stage.name)),
                       arch=r.drafter.arch, init_from=verifier, num_layers=r.drafter.num_layers,
                       num_taps=len(r.drafter.taps) or 1, gamma=r.drafter.gamma,
                       **_fields(stage, TRAIN_FIELDS), **start)


def last_checkpoint(ws: Workspace, stage: Any) -> Path:
    checkpoint = ws.run_dir(stage.name) / CKPT_DIR / f"step-{stage.steps:07d}"
    if not (checkpoint / "state.json").is_file():
        raise FileNotFoundError(f"stage {stage.name} has no checkpoint at step {stage.steps} "
                                f"({checkpoint}): run it first")
    return checkpoint


def export_run(ws: Workspace, stage: Any, out: Path, expand: bool = False,
               draft_vocab_size: int | None = None) -> Path:
    """`specdiff-distill export` of a stage's last checkpoint into `out` (replaced whole);
    `expand`: the slim export of a block-causal drafter rebuilt into the full directory that
    `train --drafter` loads, its learning curve beside (a later stage's curve continues it)."""
    from vllm_specdiff.drafter.slim import expand_checkpoint

    from ..export import CURVE_FILE, ExportConfig, run_export

    tmp = out.with_name(out.name + ".partial")
    slim = out.with_name(out.name + ".slim") if expand else tmp
    for d in (tmp, slim):
        shutil.rmtree(d, ignore_errors=True)
    run_export(ExportConfig(verifier=ws.verifier, output=str(slim),
                            run=str(last_checkpoint(ws, stage)),
                            draft_vocab_size=draft_vocab_size))
    if expand:
        expand_checkpoint(slim, ws.verifier, tmp)
        shutil.copyfile(slim / CURVE_FILE, tmp / CURVE_FILE)
        shutil.rmtree(slim)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


def export_stage(ws: Workspace, stage: Any) -> Path:
    """A stage's last checkpoint as a drafter directory (its learning curve beside), what a
    later stage starts from and evaluation scores; written once."""
    out = ws.stage_drafter(stage)
    if (out / "config.json").is_file():
        return out
    return export_run(ws, stage, out, expand=not ws.recipe.drafter.conditioned)


def train_stage(ws: Workspace, stage: Any) -> dict:
    from ..trainer import run_train

    cfg = train_config(ws, stage)
    if cfg.drafter is not None and not (Path(cfg.drafter) / "config.json").is_file():
        raise FileNotFoundError(f"stage {stage.name} starts from {stage.start}, whose drafter "
                                f"{cfg.drafter} does not exist yet: run that stage first")
    with threads(stage.threads):
        summary = run_train(cfg)  # under torchrun: on every rank (DDP), rank 0 exports
    drafter = export_stage(ws, stage) if launched_rank()[0] == 0 else ws.stage_drafter(stage)
    return {"run": cfg.output, "drafter": str(drafter), "steps": summary["steps"],
            "heldout_greedy_accepted_length": summary.get("heldout_greedy_accepted_length")}


# ---- evaluation and export ----------------------------------------------------------------------
def _eval_data(ws: Workspace, e: Any) -> Path:
    """The verifier's continuations of an evaluation's prompt source (generated once)."""
    prompts = source_prompts(ws.root / "eval" / "prompts" / f"{e.name}.jsonl",
                             ws.recipe.sources([e.prompts])[0], e.max_prompts)
    data = ws.root / "eval" / "data" / e.name
    run_generate(GenerateConfig(verifier=ws.verifier, prompts=str(prompts), output=str(data),
                                **ws.recipe.generate_settings()))
    return data


@verifier_threads
def evaluate(ws: Workspace) -> dict:
    """Each [[eval]] set on the final stage's exported drafter: the trainer's held-out prompts
    of packs, or the verifier's continuations of a prompt source (`eval --replay`: the
    accepted length serving reports)."""
    from ..evaluate import EvalConfig, run_eval

    r = ws.recipe
    stage = r.final_stage()
    by_name = {s.name: s for s in r.stages}
    out: dict[str, Any] = {}
    for e in tqdm(r.eval, desc="eval sets", unit="set"):
        data, split = (ws.data_arg(e.packs), "heldout") if e.packs else \
            (str(_eval_data(ws, e)), "all")
        path = ws.root / "eval" / f"{e.name}.json"
        scored = [stage.name] + [name for name in e.stages if name != stage.name]
        candidates = [f"{name}={export_stage(ws, by_name[name])}" for name in scored]
        result = run_eval(EvalConfig(data=data, verifier=ws.verifier, candidates=candidates,
                                     output=str(path), gamma=r.drafter.gamma, split=split,
                                     heldout_fraction=stage.heldout_fraction,
                                     **_fields(e, EVAL_FIELDS)))
        out[e.name] = {"output": str(path)}
        for name in scored:
            scores = result["results"][name]
            headline = {k: scores[k] for k in HEADLINE if scores.get(k) is not None}
            if name == stage.name:
                out[e.name].update(headline)
            else:
                out[e.name].setdefault("compared", {})[name] = headline
    return out


def export(ws: Workspace) -> dict:
    """The final stage's drafter in each asked format under WORK/export (and installed)."""
    from vllm_specdiff.drafter.conditioned import ConditionedDrafter

    from ..export_dflash import export_dflash

    r = ws.recipe
    drafter = export_stage(ws, r.final_stage())
    out: dict[str, Any] = {}
    if "specdiff" in r.export.formats:
        target = ws.root / "export" / "specdiff"
        if r.drafter.conditioned:
            shutil.copytree(drafter, target, dirs_exist_ok=True)
        else:  # the slim checkpoint the package ships, its reduced head chosen now
            drafter = export_run(ws, r.final_stage(), target,
                                 draft_vocab_size=r.drafter.draft_vocab_size)
        out["specdiff"] = str(target)
    if "dflash" in r.export.formats:
        target = ws.root / "export" / "dflash"
        model = ConditionedDrafter.from_pretrained(str(drafter), ws.verifier)
        out["dflash"] = export_dflash(model, ws.verifier, target, r.export.mask_token_id)
    if r.export.install:
        target = Path(r.resolve(r.export.install))
        shutil.copytree(drafter, target, dirs_exist_ok=True)
        out["installed"] = str(target)
    return out
