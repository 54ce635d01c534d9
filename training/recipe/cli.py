"""`specdiff-distill recipe run | new | fields`: the recipe subcommand of the training CLI."""

from __future__ import annotations

import argparse
import json
import sys

from vllm_specdiff.core import DEFAULT_GAMMA

DESCRIPTION = "make a drafter from one recipe file (data, features, stages, eval, export)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recipe", help=DESCRIPTION, description=DESCRIPTION)
    rs = p.add_subparsers(dest="recipe_command", required=True)
    run = rs.add_parser("run", help="run a recipe, resuming what exists",
                        description="run a recipe's stages in order; finished stages are "
                                    "skipped, the rest resume what exists")
    run.add_argument("recipe", help="recipe file (TOML), e.g. "
                                    "recipes/smollm2-135m-conditioned.toml")
    run.add_argument("--smoke", action="store_true",
                     help="every stage at a tiny scale (few prompts, few steps, transformers), "
                          "in its own work directory NAME-smoke")
    pick = run.add_mutually_exclusive_group()
    pick.add_argument("--from-stage", metavar="NAME", help="start at this stage (the earlier "
                                                           "ones are not run)")
    pick.add_argument("--only", metavar="NAME", help="run this stage only")
    new = rs.add_parser("new", help="write a recipe for another verifier",
                        description="write a recipe for a verifier: taps over its depth, its "
                                    "chat template, a mask stand-in, a reduced head for large "
                                    "vocabularies, self-written data")
    new.add_argument("--verifier", required=True, help="verifier model directory")
    new.add_argument("--output", required=True, help="the recipe file to write")
    new.add_argument("--name", help="the recipe's name (default: VERIFIER-conditioned)")
    new.add_argument("--num-taps", type=int, help="verifier layers tapped (default: 3, or 5 "
                                                  "from 32 layers)")
    new.add_argument("--num-layers", type=int, default=2, help="drafter layers (default: 2)")
    new.add_argument("--gamma", type=int, default=DEFAULT_GAMMA,
                     help=f"draft tokens per block (default: {DEFAULT_GAMMA})")
    new.add_argument("--num-prompts", type=int, default=2000,
                     help="requests the verifier writes (default: 2000)")
    new.add_argument("--force", action="store_true", help="replace an existing --output")
    rs.add_parser("fields", help="every recipe field with its help")
    p.set_defaults(config_cls=None)


def main(args: argparse.Namespace) -> int:
    from .fields import RecipeError

    try:
        if args.recipe_command == "run":
            from ..features import launched_rank
            from .run import format_summary, run_recipe

            summary = run_recipe(args.recipe, smoke=args.smoke, from_stage=args.from_stage,
                                 only=args.only)
            if launched_rank()[0] == 0:  # under torchrun, the summary once
                print(format_summary(summary))
        elif args.recipe_command == "new":
            from .new import new_recipe

            print(json.dumps(new_recipe(args.verifier, args.output, name=args.name,
                                        num_taps=args.num_taps, num_layers=args.num_layers,
                                        gamma=args.gamma, num_prompts=args.num_prompts,
                                        force=args.force), indent=2))
        else:
            from .fields import describe
            from .schema import Recipe

            for path, type_, help_ in describe(Recipe):
                print(f"{path} ({type_}): {help_}")
    except (RecipeError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"specdiff-distill recipe {args.recipe_command}: error: {e}", file=sys.stderr)
        return 2
    return 0
