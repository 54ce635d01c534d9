"""Engine options shared by the offline subcommands (generate, demo, bench).

The verifier engine's own options and their CPU-friendly defaults are in
`vllm_specdiff.engine_options` (the benchmark suite reads them too); this module adds the
SpecDiff flags and builds the engine.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from vllm_specdiff.commands.flags import (
    GAMMA_FLAGS,
    NUM_SPECULATIVE_TOKENS,
    SPECULATIVE_MODEL,
    add_spec_args,
    converter,
    deprecated_flags,
    flag,
    spec_options,
    spellings,
)
from vllm_specdiff.engine_options import add_engine_args, engine_kwargs, resolve_model
from vllm_specdiff.plugin.config import DECLARED

__all__ = ["add_engine_args", "add_spec_args", "build_llm", "engine_kwargs",
           "expand_speculative_model", "resolve_model", "spec_options"]


def split_option(argv: list[str], *names: str) -> tuple[list[str], list[str]]:
    """argv without `--name VALUE` / `--name=VALUE` (any of the spellings), and those values."""
    rest: list[str] = []
    values: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in names and i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 2
            continue
        if any(arg.startswith(name + "=") for name in names):
            values.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return rest, values


def option_values(argv: list[str], *names: str) -> list[str]:
    """Values of `--name VALUE` / `--name=VALUE` in argv, for any of the option's spellings."""
    return split_option(argv, *names)[1]


def json_option(argv: list[str], *names: str) -> dict | None:
    """The last value of a JSON-object option (e.g. --additional-config), or None if absent."""
    values = option_values(argv, *names)
    if not values:
        return None
    try:
        value = json.loads(values[-1])
    except json.JSONDecodeError as e:
        raise ValueError(f"{names[0]} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{names[0]} must be a JSON object")
    return value


def split_spec_flags(argv: list[str]) -> tuple[list[str], dict[str, Any], dict[str, str]]:
    """argv without the SpecDiff option flags (any spelling, `--flag V` / `--flag=V`, and
    `--adaptive` / `--no-adaptive`), the options they set, and option -> the flag as given."""
    import warnings

    section: dict[str, Any] = {}
    given: dict[str, str] = {}
    rest = list(argv)
    for name, opt in DECLARED.items():
        if opt.type is bool:
            on, off = flag(opt), "--no-" + flag(opt)[2:]
            for arg in [a for a in rest if a in (on, off)]:
                section[name], given[name] = arg == on, arg
            rest = [a for a in rest if a not in (on, off)]
            continue
        for spelling in spellings(opt):
            rest, values = split_option(rest, spelling)
            if not values:
                continue
            if spelling in deprecated_flags(opt):
                warnings.warn(f"{spelling} is deprecated; use {flag(opt)}", FutureWarning,
                              stacklevel=2)
            try:
                section[name] = converter(opt)(values[-1])
            except ValueError:
                kind = "an integer" if opt.type is int else "a number"
                raise ValueError(f"{spelling} must be {kind}, got {values[-1]!r}") from None
            given[name] = spelling
    return rest, section, given


def _default_gamma(drafter: str) -> int:
    """DEFAULT_GAMMA, or fewer when the drafter's block drafts fewer per forward (a DFlash
    drafter of block 8 drafts 7); a broken directory is named by the option check later."""
    from vllm_specdiff.core import DEFAULT_GAMMA
    from vllm_specdiff.drafter.loading import block_draft_tokens

    try:
        block = block_draft_tokens(drafter)
    except (OSError, ValueError):
        block = None
    return DEFAULT_GAMMA if block is None else min(DEFAULT_GAMMA, block)


def expand_speculative_model(argv: list[str]) -> list[str]:
    """`vllm serve` arguments with `--speculative-model DRAFTER_DIR [--num-speculative-tokens
    N]` and the SpecDiff option flags (`--drafter-temperature 1.5`, ...) written out as vLLM
    0.32 spells them: the proposer in --speculative-config, the options in --additional-config
    (merged with a specdiff section already there)."""
    from vllm_specdiff.plugin.config import SECTION
    from vllm_specdiff.plugin.engine import specdiff_engine_args

    rest, flags, given = split_spec_flags(argv)
    rest, counts = split_option(rest, *GAMMA_FLAGS)
    if "drafter" not in flags:
        if counts or flags:
            used = NUM_SPECULATIVE_TOKENS if counts else given[next(iter(flags))]
            raise ValueError(f"{used} goes with {SPECULATIVE_MODEL} DRAFTER_DIR (or set "
                             "num_speculative_tokens in --speculative-config and the options in "
                             "--additional-config)")
        return argv
    if option_values(rest, "--speculative-config", "-sc", "--spec-model", "--spec-method",
                     "--spec-tokens") \
            or any(a.startswith(("--speculative-config.", "-sc.")) for a in rest):
        raise ValueError(f"{SPECULATIVE_MODEL} is the shorthand for --speculative-config; "
                         "give one of them")
    try:
        gamma = int(counts[-1]) if counts else _default_gamma(flags["drafter"])
    except ValueError:
        raise ValueError(f"{NUM_SPECULATIVE_TOKENS} must be an integer, "
                         f"got {counts[-1]!r}") from None
    additional = json_option(rest, "--additional-config") or {}
    rest, _ = split_option(rest, "--additional-config")
    section = dict(additional.get(SECTION) or {})
    for name in flags:
        if name in section:
            raise ValueError(f"{given[name]} and --additional-config's {SECTION!r} section "
                             f"both name a {name}; give one")
    engine = specdiff_engine_args(gamma, **section, **flags)
    additional[SECTION] = engine["additional_config"][SECTION]
    return [*rest, "--speculative-config", json.dumps(engine["speculative_config"]),
            "--additional-config", json.dumps(additional)]


def build_llm(args: argparse.Namespace, model: str, speculative: bool) -> Any:
    """An in-process `vllm.LLM`, with the SpecDiff proposer when `speculative`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    from vllm_specdiff.plugin.config import check_drafter_for
    from vllm_specdiff.plugin.engine import specdiff_engine_args

    kwargs = engine_kwargs(args, model)
    if speculative:
        check_drafter_for(args.model, args.drafter)  # before the engine starts
        kwargs.update(specdiff_engine_args(args.gamma, **spec_options(args)))
    return LLM(**kwargs)
