"""The SpecDiff flags of `vllm-specdiff generate/demo/bench/serve`, generated from the options'
declaration (`plugin/config.py`): one flag per option, its type, choices and help taken from
there, so the command line cannot drift from the options it sets.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import Any

from vllm_specdiff.core import DEFAULT_GAMMA
from vllm_specdiff.plugin.config import DECLARED, Option

# The shorthand of every command for "the SpecDiff proposer with this drafter" (vLLM 0.32 itself
# spells it --speculative-config plus --additional-config; `serve` writes that out).
SPECULATIVE_MODEL = "--speculative-model"
NUM_SPECULATIVE_TOKENS = "--num-speculative-tokens"
GAMMA_FLAGS = (NUM_SPECULATIVE_TOKENS, "--gamma")
GROUP = "speculative decoding (SpecDiff drafter; docs/options.md)"


def flag(opt: Option) -> str:
    return opt.spec.flag or "--" + opt.name.replace("_", "-")


def dest(opt: Option) -> str:
    """The argparse destination (`seed` -> `drafter_seed`: the request's seed is `seed`)."""
    return flag(opt).lstrip("-").replace("-", "_")


def spellings(opt: Option) -> tuple[str, ...]:
    """Every flag that sets the option: current spellings first, then deprecated ones."""
    return (flag(opt), *opt.spec.aliases, *deprecated_flags(opt))


def deprecated_flags(opt: Option) -> tuple[str, ...]:
    return tuple(d for d in opt.spec.deprecated if d.startswith("-"))


def converter(opt: Option) -> Callable[[str], Any]:
    """Command-line text -> the option's value (a comma list for list options)."""
    if opt.type is tuple:
        return lambda text: text.split(",")
    return {int: int, float: float}.get(opt.type, str)


def help_text(opt: Option) -> str:
    if opt.nullable:
        default = opt.spec.null
    else:
        default = ",".join(opt.default) if isinstance(opt.default, tuple) else opt.default
    return f"{opt.spec.help} (default: {default})"


class DeprecatedFlag(argparse.Action):
    """Stores like the current spelling, and warns that this one is going."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        warnings.warn(f"{option_string} is deprecated; use {self.metavar}", FutureWarning,
                      stacklevel=2)
        setattr(namespace, self.dest, values)


def add_option(group: Any, name: str, help: str | None = None) -> None:
    """Add one declared option's flag (default None: the option's own default applies)."""
    opt = DECLARED[name]
    names = (flag(opt), *opt.spec.aliases)
    kw: dict[str, Any] = {"dest": dest(opt), "default": None,
                          "help": help or help_text(opt)}
    if opt.type is bool:
        group.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        return
    metavar = {"directory": "DIR", "file": "FILE"}.get(opt.spec.path)
    if opt.type is tuple:
        metavar = ",".join(opt.spec.choices)
    choices = opt.spec.choices if opt.type is str and opt.spec.choices else None
    kw.update(type=converter(opt), choices=choices, metavar=metavar)
    group.add_argument(*names, **kw)
    if deprecated_flags(opt):
        group.add_argument(*deprecated_flags(opt), action=DeprecatedFlag, dest=dest(opt),
                           type=converter(opt), metavar=flag(opt), default=argparse.SUPPRESS,
                           help=argparse.SUPPRESS)


def add_gamma(group: Any, help: str = "draft tokens per step (gamma)") -> None:
    group.add_argument(*GAMMA_FLAGS, type=int, default=DEFAULT_GAMMA, dest="gamma",
                       help=f"{help} (default: {DEFAULT_GAMMA})")


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    """gamma and one flag per SpecDiff option."""
    g = parser.add_argument_group(GROUP)
    add_gamma(g)
    for name in DECLARED:
        add_option(g, name)


def spec_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options the flags set, by option name (None: not given)."""
    return {name: getattr(args, dest(opt), None) for name, opt in DECLARED.items()}
