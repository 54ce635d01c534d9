"""`vllm-specdiff models`: prepare the default models if needed and print where they are.

Output is one `name: PATH` line per model, so scripts can read it
(`vllm-specdiff models | sed -n 's/^verifier: //p'`): `verifier`, `drafter` (the default
drafter, `models.DEFAULT_DRAFTER_KIND`), then both shipped drafters by kind
(`standalone drafter`, `conditioned drafter`), whichever is the default.
"""

from __future__ import annotations

import argparse

USES_VLLM = False


def run(args: argparse.Namespace) -> int:
    from vllm_specdiff import models

    paths = models.prepare_defaults(force=args.force)
    # both shipped drafters by path, so the one that is not the default stays usable
    paths["standalone drafter"] = models.prepare_standalone_drafter(force=args.force)
    paths["conditioned drafter"] = models.CONDITIONED_DRAFTER
    for name, path in paths.items():
        print(f"{name}: {path}", flush=True)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `models` subcommand."""
    p = subparsers.add_parser(
        "models", help="prepare the default verifier and drafter; print their paths",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.set_defaults(func=run)
