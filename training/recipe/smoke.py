"""`--smoke`: the whole recipe at a tiny scale, to see every stage run in minutes.

Every count is capped (prompts, tokens, shards, steps, windows), the verifier runs through
transformers, and more prompts are held out so that a few sequences still leave held-out
windows to evaluate. The work lands in its own directory (NAME-smoke).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .schema import Recipe

TRAIN_CAPS = {"steps": 3, "batch_size": 2, "windows_per_seq": 4, "grad_accum": 1,
              "eval_windows": 16, "save_every": 2, "warmup_steps": 1, "threads": 1}
GENERATE_CAPS = {"max_new_tokens": 24, "chunk_size": 4, "batch_size": 8, "num_samples": 1}
SELF_PROMPTS_CAPS = {"num_prompts": 12, "samples_per_round": 12, "max_rounds": 2,
                     "answer_tokens": 16, "max_request_tokens": 24, "samples_per_prefix": 4}
CORPUS_CAPS = {"num_code": 4, "num_chat": 4}
PROMPTS_CAPS = {"max_prompts": 8}
EVAL_CAPS = {"max_windows": 32, "windows_per_seq": 4, "batch_size": 8, "max_prompts": 4}
SMOKE_STYLES = "open"  # one sampling call per round (the styles have tests of their own)
SMOKE_HELDOUT = 0.3  # held-out share of the prompts, at least


def _capped(obj: Any, caps: dict[str, int], keep_none: bool = False, **sets: Any) -> Any:
    """obj with each capped field at most its cap (a None count becomes the cap, or stays None
    with `keep_none`: an override that is not set)."""
    values = {k: cap if getattr(obj, k) is None else min(getattr(obj, k), cap)
              for k, cap in caps.items() if not (keep_none and getattr(obj, k) is None)}
    return dataclasses.replace(obj, **values, **sets)


def _pack(pack: Any, caps: dict[str, int], **sets: Any) -> Any:
    """A new pack at smoke scale, its own generation settings capped too."""
    return _capped(pack, caps, generate=_capped(pack.generate, GENERATE_CAPS, keep_none=True),
                   **sets)


def _corpus(pack: Any) -> Any:
    # a small source tree instead of scanning all of site-packages for code requests
    roots = pack.source_roots or [str(Path(json.__file__).parent)]
    return _pack(pack, CORPUS_CAPS, source_roots=roots)


def smoke_recipe(r: Recipe) -> Recipe:
    """The recipe at smoke scale (same stages, same names)."""
    data = dataclasses.replace(
        r.data, subsets=[dataclasses.replace(s, shards=1) for s in r.data.subsets],
        corpus=[_corpus(p) for p in r.data.corpus],
        # a committed state cannot resume at smoke settings: the smoke run starts afresh
        self_prompts=[_pack(p, SELF_PROMPTS_CAPS, styles=SMOKE_STYLES, state=None)
                      for p in r.data.self_prompts],
        prompts=[_pack(p, PROMPTS_CAPS) for p in r.data.prompts])
    stages = [_capped(s, TRAIN_CAPS, eval_every=0,
                      heldout_fraction=max(s.heldout_fraction, SMOKE_HELDOUT))
              for s in r.stages]
    smoke = dataclasses.replace(
        r, data=data, stages=stages, eval=[_capped(e, EVAL_CAPS) for e in r.eval],
        generate=_capped(r.generate, GENERATE_CAPS, backend="transformers", threads=1))
    smoke.base_dir = r.base_dir
    return smoke
