"""The data side of a recipe: committed packs unpacked, subsets cut, new packs made.

A new pack is made in four steps, each the step that already exists and each resumable: its
prompts (`run_corpus`, `run_self_prompts` or a prompt source; written once, beside the settings
they were written with), the verifier's continuations (`run_generate`: the shards that exist are
kept), decontamination (`decontaminate.drop_prompts` of corpus chat on held-out topics; a rerun
drops nothing more) and, with `generate.pack`, its .npz (`data_pack.pack`) into data.packs_dir,
to commit. A pack marked `committed` is unpacked instead, so a fresh clone regenerates nothing it
already has.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..data import META_FILE
from ..generate import GenerateConfig, run_generate
from .data_schema import pack_config
from .schema import Recipe
from .stages import source_prompts, verifier_threads, write_prompts
from .workspace import Workspace

log = logging.getLogger(__name__)

SMOKE_SHARDS = 1  # --smoke trains on each committed pack's first shard,
SMOKE_SEQUENCES = 8  # and on that shard's first sequences only
OWN_FIELDS = ("name", "committed", "generate")  # pack fields that do not change its prompts


# ---- committed packs and subsets ----------------------------------------------------------------
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
    for name in tqdm(r.committed_packs(), desc="unpack", unit="pack"):
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


# ---- the prompts of new packs -------------------------------------------------------------------
def prompts_path(ws: Workspace, pack: Any) -> Path:
    return ws.root / "corpus" / f"{pack.name}.jsonl"


def prompt_settings(pack: Any) -> dict[str, Any]:
    """What decides a new pack's prompts (its name, state and generation do not)."""
    return {k: v for k, v in dataclasses.asdict(pack).items() if k not in (*OWN_FIELDS, "state")}


def earlier_corpora(r: Recipe, pack: Any) -> list[Any]:
    """The corpus packs listed before `pack` whose prompts it must not repeat."""
    if not pack.exclude_earlier:
        return []
    index = next(i for i, p in enumerate(r.data.corpus) if p is pack)
    return r.data.corpus[:index]


def corpus_prompts(ws: Workspace, pack: Any) -> Path:
    """A corpus pack's prompt file; the corpora it must not repeat are built first (a committed
    pack's corpus too: the exclusion needs its prompts, not its continuations)."""
    from ..corpus import run_corpus

    path = prompts_path(ws, pack)
    earlier = earlier_corpora(ws.recipe, pack)
    exclude = [str(prompts_path(ws, e)) for e in earlier]

    def make(out: Path) -> None:
        for e in earlier:  # built (once) only when this corpus is
            corpus_prompts(ws, e)
        run_corpus(pack_config(ws.recipe, "corpus", pack, output=str(out), exclude=exclude))

    write_prompts(path, {**prompt_settings(pack), "exclude": exclude}, make)
    return path


def self_written_prompts(ws: Workspace, pack: Any) -> Path:
    """Requests the verifier writes itself; a committed state file of a stopped run is copied
    in first when the work directory has none, so sampling goes on from its next round."""
    from ..self_prompts import run_self_prompts

    path, gen = prompts_path(ws, pack), ws.recipe.generate
    cfg = pack_config(ws.recipe, "self_prompts", pack, verifier=ws.verifier, output=str(path),
                      backend=gen.backend, dtype=gen.dtype, device=gen.device)
    state = Path(f"{path}.state.json")  # where run_self_prompts keeps its rounds
    if pack.state and not path.is_file() and not state.is_file():
        state.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ws.recipe.resolve(pack.state), state)
        log.info("generate:%s: going on from the stopped run %s", pack.name, pack.state)
    # run_self_prompts writes its output whole at the end, so no partial file is needed
    write_prompts(path, prompt_settings(pack), lambda _: run_self_prompts(cfg), partial=False)
    return path


def given_prompts(ws: Workspace, pack: Any) -> Path:
    return source_prompts(prompts_path(ws, pack), ws.recipe.sources([pack.source])[0],
                          pack.max_prompts)


PROMPT_MAKERS: dict[str, Callable[[Workspace, Any], Path]] = {
    "corpus": corpus_prompts, "self_prompts": self_written_prompts, "prompts": given_prompts}


def packs_out(ws: Workspace) -> Path:
    """Where `generate.pack` writes a made pack's .npz: the committed packs' folder (a smoke run:
    its own packs/, never the repository)."""
    return ws.root / "packs" if ws.smoke else Path(ws.recipe.resolve(ws.recipe.data.packs_dir))


# ---- a new pack ---------------------------------------------------------------------------------
@verifier_threads
def make_pack(ws: Workspace, table: str, pack: Any) -> dict:
    """A new pack: its prompts, the verifier's continuations, decontamination and, asked, its
    .npz."""
    from ..decontaminate import drop_prompts, heldout_prompt_numbers

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as the scripts ran vLLM
    stage = f"generate:{pack.name}"
    log.info("%s: prompts (%s)", stage, table)
    prompts = PROMPT_MAKERS[table](ws, pack)
    data = ws.data_dir(pack.name)
    settings = ws.recipe.generate_settings(pack)
    log.info("%s: continuations (temperature %g, %d new tokens at most)", stage,
             settings["temperature"], settings["max_new_tokens"])
    result = run_generate(GenerateConfig(verifier=ws.verifier, prompts=str(prompts),
                                         output=str(data), **settings))
    heldout = heldout_prompt_numbers(prompts)  # chat on held-out (benchmark) topics
    out: dict[str, Any] = {"prompts": str(prompts), "data": str(data), "shards": result["shards"],
                           "dropped_sequences": drop_prompts(data, heldout) if heldout else 0}
    log.info("%s: decontaminated (%d sequences dropped)", stage, out["dropped_sequences"])
    if ws.recipe.generate.pack:
        from ..data_pack import pack as pack_data

        out["pack"] = str(pack_data(data, packs_out(ws)))
        log.info("%s: packed into %s", stage, out["pack"])
    return out
