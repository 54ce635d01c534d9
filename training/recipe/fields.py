"""Typed recipe tables: each TOML table is a dataclass whose fields carry their help, so a
misspelt key or a value of the wrong kind fails naming its place in the file (`stages[2].lr`)
instead of silently training with a default.

Tables that configure an existing step (`generate`, `train`, `corpus`, `self-prompts`, `eval`)
are derived from that step's config dataclass (`derive`): the same field names, types and
defaults, and the help of `specdiff-distill`'s flags, so nothing is declared twice.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from dataclasses import MISSING, Field, field
from typing import Any

# Section classes by name, so a field typed "DataSpec" or "list[StageSpec]" parses as a table.
SECTIONS: dict[str, type] = {}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # names of packs, stages, evaluations


class RecipeError(ValueError):
    """Every problem of a recipe at once, each naming its table path."""

    def __init__(self, problems: list[str], source: str = "recipe") -> None:
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s):\n  "
                         + "\n  ".join(problems))


def section(cls: type) -> type:
    """Register a dataclass as a recipe table type."""
    SECTIONS[cls.__name__] = cls
    return cls


def spec(default: Any = MISSING, help: str = "", *, choices: tuple[str, ...] = (),
         minimum: float | None = None) -> Any:
    """A recipe field: its default (none: required), one line of help, and its bounds."""
    meta = {"help": help, "choices": tuple(choices), "minimum": minimum}
    if isinstance(default, list | dict) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def all_but(base: type, drop: set[str]) -> tuple[str, ...]:
    """`base`'s field names without `drop`: a table's share of an existing config."""
    return tuple(f.name for f in dataclasses.fields(base) if f.name not in drop)


def name_field(help: str) -> tuple[str, str, Any]:
    return ("name", "str", spec(help=help))


def check_name(kind: str, where: str, name: str, problems: list[str]) -> None:
    if not NAME.match(name):
        problems.append(f"{where}: {kind} names are letters, digits, '.', '_' and '-', "
                        f"got {name!r}")


def config_problem(where: str, make: Any, problems: list[str]) -> None:
    """The existing config's own checks, their message placed in the recipe."""
    try:
        make().validate()
    except (ValueError, TypeError) as e:
        problems.append(f"{where}: {e}")


def help_of(f: Field) -> str:
    return f.metadata.get("help", "")


def default_of(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def derive(name: str, base: type, fields: tuple[str, ...], *,
           defaults: dict[str, Any] | None = None,
           choices: dict[str, tuple[str, ...]] | None = None,
           minimum: dict[str, float] | None = None,
           extra: tuple[tuple[str, str, Any], ...] = (), optional: bool = False) -> type:
    """A table made of `base`'s `fields` (their types and defaults, or `defaults`), their help
    from the CLI's HELP, after the `extra` (name, type, spec(...)) fields. `optional`: every
    field absent by default (None), for a table that overrides another one's settings."""
    from ..flag_help import HELP

    defaults, choices, minimum = defaults or {}, choices or {}, minimum or {}
    own = {f.name: f for f in dataclasses.fields(base)}
    unknown = [n for n in (*fields, *defaults) if n not in own]
    if unknown:
        raise TypeError(f"{base.__name__} has no field(s) {unknown}")
    specs = list(extra)
    for n in fields:
        default = defaults[n] if n in defaults else default_of(own[n])
        help = HELP.get(n, "").replace("comma-separated ", "")  # a TOML list, not a flag
        type_ = str(own[n].type)
        if optional:
            default, type_ = None, type_ if type_.endswith("| None") else f"{type_} | None"
        specs.append((n, type_, spec(default, help,
                                                choices=choices.get(n, ()),
                                                minimum=minimum.get(n))))
    required = [s for s in specs if s[2].default is MISSING and s[2].default_factory is MISSING]
    rest = [s for s in specs if s not in required]
    return section(dataclasses.make_dataclass(name, required + rest))


def _where(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else key


def parse_table(cls: type, table: Any, where: str, problems: list[str]) -> Any:
    """`cls(**table)` with every key known and every value of its field's type; problems are
    appended (each naming `where.key`) and None returned when there are any."""
    if not isinstance(table, dict):
        problems.append(f"{where or 'the recipe'}: must be a table, got {table!r}")
        return None
    before = len(problems)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in table:
        if key not in fields:
            near = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else \
                f"; the fields are {', '.join(fields)}"
            problems.append(f"{_where(where, key)}: unknown field{hint}")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        path = _where(where, name)
        if name in table:
            values[name] = check_value(f, str(f.type), table[name], path, problems)
        elif default_of(f) is MISSING:
            problems.append(f"{path}: required ({help_of(f)})")
    return cls(**values) if len(problems) == before else None


_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def check_value(f: Field, type_: str, value: Any, where: str, problems: list[str]) -> Any:
    """The value as field `f` holds it (ints widened to float, tables parsed), or None with a
    problem appended."""
    base = type_.replace(" | None", "").strip()
    if base.startswith("list[") and base.endswith("]"):
        if not isinstance(value, list):
            problems.append(f"{where}: must be a list, got {value!r}")
            return None
        return [check_value(f, base[5:-1], v, f"{where}[{i}]", problems)
                for i, v in enumerate(value)]
    if base in SECTIONS:
        return parse_table(SECTIONS[base], value, where, problems)
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, int | float) and not isinstance(value, bool),
          "str": isinstance(value, str), "bool": isinstance(value, bool)}.get(base)
    if ok is None:
        raise TypeError(f"{where}: recipe fields cannot be of type {type_}")
    if not ok:
        problems.append(f"{where}: must be {_KINDS[base]}, got {value!r}")
        return None
    choices, minimum = f.metadata.get("choices", ()), f.metadata.get("minimum")
    if choices and value not in choices:
        problems.append(f"{where}: must be one of {', '.join(choices)}; got {value!r}")
    if minimum is not None and value < minimum:
        problems.append(f"{where}: must be >= {minimum:g}, got {value!r}")
    return float(value) if base == "float" else value


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(table path, type, help) of every field, nested tables flattened: the recipe reference."""
    rows = []
    for f in dataclasses.fields(cls):
        base = str(f.type).replace(" | None", "")
        inner = base[5:-1] if base.startswith("list[") else base
        path = _where(prefix, f.name) + ("[]" if inner in SECTIONS and inner != base else "")
        if inner in SECTIONS:
            rows += describe(SECTIONS[inner], path)
        else:
            rows.append((path, str(f.type), help_of(f)))
    return rows
