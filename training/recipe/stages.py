"""What each stage of a recipe does: a call of the step that already exists for it.

data: `data_pack.unpack` and links to a pack's first shards (the script's design-data);
new packs: `run_corpus` / `run_self_prompts`, `run_generate`, `decontaminate.drop_prompts`,
`data_pack.pack`; features: `build_features`; a training stage: `run_train` (which resumes from
its latest checkpoint) and `run_export` of its last checkpoint; eval: `run_eval`; export:
`export_dflash`. Each is resumable by the step it calls (shards, feature shards and checkpoints
that exist are kept).
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from ..data import META_FILE
from ..generate import GenerateConfig, run_generate
from ..trainer import CKPT_DIR, TrainConfig
from .schema import EVAL_FIELDS, TRAIN_FIELDS, VERIFIER_START
from .workspace import Workspace

log = logging.getLogger(__name__)

# what an evaluation reports per set (those its settings measured)
HEADLINE = ("replay_accepted_per_step", "data_greedy_accepted_length", "verifier_token_streak",
            "greedy_accepted_length", "expected_accepted_length", "windows")
SMOKE_SHARDS = 1  # --smoke trains on each committed pack's first shard,
SMOKE_SEQUENCES = 8  # and on that shard's first sequences only


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


def generate_settings(ws: Workspace) -> dict[str, Any]:
    """The recipe's [generate] as GenerateConfig keywords."""
    names = {f.name for f in dataclasses.fields(GenerateConfig)}
    return {k: v for k, v in dataclasses.asdict(ws.recipe.generate).items() if k in names}


def _paths(ws: Workspace, sources: list[str]) -> list[str]:
    """Prompt sources / folders of the recipe: .jsonl files and folders relative to it."""
    return [ws.recipe.resolve(s) if s.endswith(".jsonl") or "/" in s else s for s in sources]


# ---- data ---------------------------------------------------------------------------------------
def cut_subset(src: Path, dst: Path, shards: int) -> Path:
    """The first `shards` shards of a data directory as links, with its meta: verifier features
    are cached beside the real shard files, so the subset and its pack share them."""
    files = sorted(src.glob("shard-*.safetensors"))[:shards]
    if not files:
        raise FileNotFoundError(f"{src}: no shards to cut a subset from")
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / META_FILE, dst / META_FILE)
    for f in files:
        if not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    return dst


def keep_first_sequences(data_dir: Path, count: int) -> int:
    """Rewrite a data directory without its sequences past the first `count` (decontaminate's
    rewrite: a linked shard becomes a file of its own); returns how many went."""
    from safetensors.torch import load_file

    from ..decontaminate import drop_prompts

    numbers = [n for shard in sorted(data_dir.glob("shard-*.safetensors"))
               for n in load_file(str(shard))["prompt_index"].tolist()]
    return drop_prompts(data_dir, set(numbers[count:]))


def unpack_data(ws: Workspace) -> dict:
    """Committed packs into data directories (with --smoke: the first sequences of their first
    shard), then subsets."""
    from ..data_pack import unpack

    r = ws.recipe
    packs_dir = Path(r.resolve(r.data.packs_dir))
    out: dict[str, str] = {}
    for name in tqdm(r.data.packs, desc="unpack", unit="pack"):
        if ws.smoke:
            full = unpack(packs_dir / f"{name}.npz", ws.root / "unpacked")
            small = cut_subset(full, ws.data_dir(name), SMOKE_SHARDS)
            keep_first_sequences(small, SMOKE_SEQUENCES)
            out[name] = str(small)
        else:
            out[name] = str(unpack(packs_dir / f"{name}.npz", ws.root / "data"))
    for s in r.data.subsets:
        out[s.name] = str(cut_subset(ws.data_dir(s.pack), ws.data_dir(s.name), s.shards))
    return out


def _write_prompts(path: Path, make: Any) -> None:
    """A prompt file written once: `make(tmp)` writes it, then it takes its name (a crash
    leaves no half file that a rerun would take for finished)."""
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial.jsonl")
    make(tmp)
    tmp.replace(path)


@verifier_threads
def make_pack(ws: Workspace, kind: str, pack: Any, earlier: list[str]) -> dict:
    """A new pack: its prompts (a corpus, or requests the verifier writes), the verifier's
    continuations, decontamination (corpus chat on held-out topics) and, asked, its .npz."""
    from ..corpus import CorpusConfig, run_corpus
    from ..decontaminate import drop_prompts, heldout_prompt_numbers
    from ..self_prompts import SelfPromptsConfig, run_self_prompts

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as the script ran vLLM
    gen = ws.recipe.generate
    prompts = ws.root / "corpus" / f"{pack.name}.jsonl"
    if kind == "corpus":
        kw = _fields(pack, [f.name for f in dataclasses.fields(CorpusConfig)
                            if hasattr(pack, f.name)])
        kw["source_roots"] = _paths(ws, kw["source_roots"])
        exclude = earlier if pack.exclude_earlier else []
        _write_prompts(prompts, lambda tmp: run_corpus(CorpusConfig(output=str(tmp),
                                                                    exclude=exclude, **kw)))
    else:
        kw = _fields(pack, [f.name for f in dataclasses.fields(SelfPromptsConfig)
                            if hasattr(pack, f.name)])
        kw["benchmark_prompts"] = _paths(ws, kw["benchmark_prompts"])
        _write_prompts(prompts, lambda tmp: run_self_prompts(SelfPromptsConfig(
            verifier=ws.verifier, output=str(tmp), backend=gen.backend, dtype=gen.dtype,
            device=gen.device, **kw)))
    data = ws.data_dir(pack.name)
    result = run_generate(GenerateConfig(verifier=ws.verifier, prompts=str(prompts),
                                         output=str(data), **generate_settings(ws)))
    out: dict[str, Any] = {"prompts": str(prompts), "data": str(data), "shards": result["shards"]}
    if kind == "corpus":
        out["dropped_sequences"] = drop_prompts(data, heldout_prompt_numbers(prompts))
    if gen.pack:
        from ..data_pack import pack as pack_data

        out["pack"] = str(pack_data(data, ws.root / "packs"))
    return out


@verifier_threads
def build_pack_features(ws: Workspace, packs: list[str]) -> dict:
    """The verifier features of every pack a stage or evaluation reads, ahead of training."""
    from ..features import build_features

    taps = tuple(ws.recipe.drafter.taps)
    return {"packs": packs, "taps": list(taps),
            "shards_built": build_features(ws.data_arg(packs), ws.verifier, taps)}


# ---- training -----------------------------------------------------------------------------------
def train_config(ws: Workspace, stage: Any) -> TrainConfig:
    """`specdiff-distill train` of a recipe stage."""
    r = ws.recipe
    if stage.start == VERIFIER_START:
        start: dict[str, Any] = {"draft_vocab_size": r.drafter.draft_vocab_size}
    elif "/" in stage.start:
        start = {"drafter": r.resolve(stage.start)}
    else:
        earlier = {s.name: s for s in r.stages}[stage.start]
        start = {"drafter": str(ws.stage_drafter(earlier))}
    return TrainConfig(data=ws.data_arg(stage.packs), output=str(ws.run_dir(stage.name)),
                       arch="conditioned", init_from=ws.verifier, num_layers=r.drafter.num_layers,
                       num_taps=len(r.drafter.taps), gamma=r.drafter.gamma,
                       **_fields(stage, TRAIN_FIELDS), **start)


def export_stage(ws: Workspace, stage: Any) -> Path:
    """A stage's last checkpoint as a drafter directory (float16, its learning curve beside),
    what a later stage starts from; written once."""
    from ..export import ExportConfig, run_export

    out = ws.stage_drafter(stage)
    if (out / "config.json").is_file():
        return out
    checkpoint = ws.run_dir(stage.name) / CKPT_DIR / f"step-{stage.steps:07d}"
    if not (checkpoint / "state.json").is_file():
        raise FileNotFoundError(f"stage {stage.name} has no checkpoint at step {stage.steps} "
                                f"({checkpoint}): run it first")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    run_export(ExportConfig(verifier=ws.verifier, output=str(tmp), run=str(checkpoint)))
    tmp.replace(out)
    return out


def train_stage(ws: Workspace, stage: Any) -> dict:
    from ..trainer import run_train

    cfg = train_config(ws, stage)
    if cfg.drafter is not None and not (Path(cfg.drafter) / "config.json").is_file():
        raise FileNotFoundError(f"stage {stage.name} starts from {stage.start}, whose drafter "
                                f"{cfg.drafter} does not exist yet: run that stage first")
    with threads(stage.threads):
        summary = run_train(cfg)
    return {"run": cfg.output, "drafter": str(export_stage(ws, stage)), "steps": summary["steps"],
            "heldout_greedy_accepted_length": summary.get("heldout_greedy_accepted_length")}


# ---- evaluation and export ----------------------------------------------------------------------
def _eval_data(ws: Workspace, e: Any) -> Path:
    """The verifier's continuations of an evaluation's prompt source (generated once)."""
    from vllm_specdiff.prompts import load_prompts

    prompts = ws.root / "eval" / "prompts" / f"{e.name}.jsonl"
    source = _paths(ws, [e.prompts])[0]

    def write(tmp: Path) -> None:
        tmp.write_text("".join(json.dumps({"messages": m}) + "\n"
                               for m in load_prompts(source, e.max_prompts)))

    _write_prompts(prompts, write)
    data = ws.root / "eval" / "data" / e.name
    run_generate(GenerateConfig(verifier=ws.verifier, prompts=str(prompts), output=str(data),
                                **generate_settings(ws)))
    return data


@verifier_threads
def evaluate(ws: Workspace) -> dict:
    """Each [[eval]] set on the final stage's exported drafter: the trainer's held-out prompts
    of packs, or the verifier's continuations of a prompt source (`eval --replay`: the
    accepted length serving reports)."""
    from ..evaluate import EvalConfig, run_eval

    r = ws.recipe
    stage = r.final_stage()
    drafter = export_stage(ws, stage)
    out: dict[str, Any] = {}
    for e in tqdm(r.eval, desc="eval sets", unit="set"):
        data, split = (ws.data_arg(e.packs), "heldout") if e.packs else \
            (str(_eval_data(ws, e)), "all")
        path = ws.root / "eval" / f"{e.name}.json"
        result = run_eval(EvalConfig(data=data, verifier=ws.verifier,
                                     candidates=[f"{stage.name}={drafter}"], output=str(path),
                                     gamma=r.drafter.gamma, split=split,
                                     heldout_fraction=stage.heldout_fraction,
                                     **_fields(e, EVAL_FIELDS)))
        scores = result["results"][stage.name]
        out[e.name] = {"output": str(path), **{k: scores[k] for k in HEADLINE
                                               if scores.get(k) is not None}}
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
        shutil.copytree(drafter, target, dirs_exist_ok=True)
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
