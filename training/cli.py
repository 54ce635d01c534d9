"""`specdiff-distill`: generate verifier data, streak-distil a drafter, evaluate it.

    specdiff-distill corpus --output prompts.jsonl --heldout-output chat_heldout.jsonl
    specdiff-distill self-prompts --verifier DIR --output self.jsonl --num-prompts 2000
    specdiff-distill generate --verifier DIR --prompts prompts.jsonl --output data/
    specdiff-distill train --data data/ --drafter DRAFTER_DIR --output runs/streak
    specdiff-distill eval --data data/ --verifier DIR --candidate base=DRAFTER_DIR \\
        --candidate runs/streak --output runs/eval.json
    specdiff-distill datastore --data data/ --output datastore.safetensors
    specdiff-distill recipe run recipes/smollm2-135m-conditioned.toml [--smoke]

Options mirror the fields of GenerateConfig / TrainConfig / EvalConfig (one flag per field), so
the CLI, the Python API and the saved train_config.json all use the same names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from .flag_help import HELP

SINGULAR = {"candidates": "candidate"}
# old flags, still accepted with a warning: field -> flags
DEPRECATED = {"drafter_temperature": ("--draft-temperature",)}
REQUIRED = {"corpus": {"output"}, "self-prompts": {"verifier", "output"},
            "generate": {"verifier", "prompts", "output"},
            "train": {"data", "output"}, "eval": {"data", "verifier", "candidates"},
            "export": {"verifier", "output"}, "datastore": {"data", "output"},
            "curves": {"runs", "output"}}


def _add_fields(parser: argparse.ArgumentParser, cls: type, required: set[str]) -> None:
    """One flag per dataclass field; its default and type come from the dataclass."""
    for f in dataclasses.fields(cls):
        flag = "--" + SINGULAR.get(f.name, f.name).replace("_", "-")
        kw: dict[str, Any] = {"dest": f.name, "help": HELP.get(f.name, "")}
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        t = str(f.type)
        if f.name == "candidates":
            kw.update(action="append", default=[])
        elif t == "bool":
            kw.update(action=argparse.BooleanOptionalAction, default=default)
        elif t.startswith("list"):
            item = int if t == "list[int]" else str
            kw.update(type=lambda s, item=item: [item(x) for x in s.split(",") if x],
                      default=default)
        else:
            base = t.replace(" | None", "")
            kw.update(type={"int": int, "float": float}.get(base, str), default=default)
        if f.name in required:
            kw["required"] = True
            kw.pop("default", None)
        kw["help"] += "" if default in (None, [], "") or kw.get("required") else \
            f" (default: {','.join(map(str, default)) if isinstance(default, list) else default})"
        parser.add_argument(flag, **kw)
        for old in DEPRECATED.get(f.name, ()):
            parser.add_argument(old, dest=f.name, type=kw["type"], action=_Deprecated,
                                metavar=flag, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


class _Deprecated(argparse.Action):
    """An old spelling of a flag: stores like the new one, and warns."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        warnings.warn(f"{option_string} is deprecated; use {self.metavar}", FutureWarning,
                      stacklevel=2)
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    from .corpus import CorpusConfig
    from .curves import CurvesConfig
    from .datastore import DatastoreConfig
    from .evaluate import EvalConfig
    from .export import ExportConfig
    from .generate import GenerateConfig
    from .self_prompts import SelfPromptsConfig
    from .trainer import TrainConfig

    parser = argparse.ArgumentParser(prog="specdiff-distill", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, cls, desc in (
            ("corpus", CorpusConfig, "build a training prompt corpus (installed Python source + "
                                     "chat instructions)"),
            ("self-prompts", SelfPromptsConfig, "chat requests written by the verifier "
                                                "itself, benchmark material dropped"),
            ("generate", GenerateConfig, "prompts -> verifier continuations (token-id shards)"),
            ("train", TrainConfig, "streak-distil a drafter on verifier sequences"),
            ("eval", EvalConfig, "accepted lengths and acceptance curves against the verifier"),
            ("export", ExportConfig, "a full fine-tuning run -> slim drafter directory + its "
                                     "learning curve"),
            ("datastore", DatastoreConfig, "verifier data -> a retrieval datastore file (the "
                                           "training split's continuations)"),
            ("curves", CurvesConfig, "training runs' held-out learning curves side by side "
                                     "(JSON + PNG)")):
        p = sub.add_parser(name, help=desc, description=desc)
        _add_fields(p, cls, REQUIRED[name])
        p.set_defaults(config_cls=cls)
    from .recipe.cli import add_parser as add_recipe_parser

    add_recipe_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command == "recipe":
        from .recipe.cli import main as recipe_main

        return recipe_main(args)
    cls = args.config_cls
    names = {f.name for f in dataclasses.fields(cls)}
    cfg = cls(**{k: v for k, v in vars(args).items() if k in names})
    try:
        if args.command == "corpus":
            from .corpus import run_corpus

            result = run_corpus(cfg)
        elif args.command == "self-prompts":
            from .self_prompts import run_self_prompts

            result = run_self_prompts(cfg)
        elif args.command == "generate":
            from .generate import run_generate

            result = run_generate(cfg)
        elif args.command == "train":
            from .trainer import run_train

            result = run_train(cfg)
        elif args.command == "export":
            from .export import run_export

            result = run_export(cfg)
        elif args.command == "curves":
            from .curves import run_curves

            result = run_curves(cfg)
        elif args.command == "datastore":
            from .datastore import run_datastore

            result = run_datastore(cfg)
        else:
            from .evaluate import run_eval

            result = run_eval(cfg)
            result = {"output": cfg.output, "results": {
                k: {m: v[m] for m in ("expected_accepted_length", "greedy_accepted_length",
                                      "expected_accepted_length_selected",
                                      "verifier_token_streak", "data_greedy_accepted_length",
                                      "windows")}
                for k, v in result["results"].items()}}
    except (ValueError, FileNotFoundError) as e:
        print(f"specdiff-distill {args.command}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
