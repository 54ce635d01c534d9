"""vLLM's recommended CPU runtime settings, applied before the process loads torch.

vLLM's CPU backend warns that it "loses much speed" without tcmalloc and Intel OpenMP
(`libiomp5`, from the `intel-openmp` wheel) in `LD_PRELOAD`, and it binds one OpenMP thread per
physical core while reserving a core for its scheduler process (`VLLM_CPU_OMP_THREADS_BIND=auto`).
That binding happens only in its multi-process executor. An engine in this process (what
`vllm-specdiff generate/demo/bench` use, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) schedules between
steps in the same thread, so no core needs reserving: it gets one OpenMP thread per physical core,
with Intel OpenMP's short spin-wait (vLLM's KMP_BLOCKTIME/KMP_TPAUSE) instead of libgomp's, which
collapses when other processes share the cores (measured in docs/vllm.md). `LD_PRELOAD` only acts
when a process starts, so the CLI re-executes itself once with these settings (`--no-speed-env`
skips it).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from collections.abc import Mapping, MutableMapping

APPLIED_FLAG = "SPECDIFF_SPEED_ENV"
_TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                  "/usr/lib", "/usr/local/lib")


def find_tcmalloc() -> str | None:
    """tcmalloc bundled with vLLM (vllm/libs), else the system's (apt: libtcmalloc-minimal4)."""
    candidates = []
    spec_dirs = [os.path.join(p, "vllm", "libs") for p in sys.path if p]
    for directory in (*spec_dirs, *_TCMALLOC_DIRS):
        for pattern in ("libtcmalloc_minimal.so*", "libtcmalloc.so*"):
            candidates.extend(sorted(glob.glob(os.path.join(directory, pattern))))
    if candidates:
        return candidates[0]
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if "libtcmalloc" in line and "=>" in line:
            return line.split("=>")[-1].strip()
    return None


def find_iomp() -> str | None:
    """libiomp5.so installed by the `intel-openmp` wheel (into <prefix>/lib)."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = os.path.join(prefix, "lib", "libiomp5.so")
        if os.path.isfile(path):
            return path
    return None


def physical_cores() -> int:
    """CPUs this process may run on, counting one per physical core (SMT siblings once)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not allowed:
        return os.cpu_count() or 1
    cores = set()
    for cpu in allowed:
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id"
        pkg = f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id"
        try:
            with open(path) as f, open(pkg) as g:
                cores.add((g.read().strip(), f.read().strip()))
        except OSError:
            cores.add(("?", str(cpu)))
    return max(1, len(cores))


def recommended_env(environ: Mapping[str, str] | None = None,
                    threads: int | None = None) -> dict[str, str]:
    """The variables to add to `environ` (never overriding what the user already set).

    threads: OpenMP threads for an in-process engine; default one per physical core.
    """
    environ = os.environ if environ is None else environ
    preload = [p for p in environ.get("LD_PRELOAD", "").split(":") if p]
    add = []
    tcmalloc = find_tcmalloc()
    if tcmalloc and not any("libtcmalloc" in p for p in preload):
        add.append(tcmalloc)
    iomp = find_iomp()
    has_omp = any(name in p for p in preload for name in ("libiomp", "libgomp", "libomp"))
    if iomp and not has_omp:
        add.append(iomp)
    env: dict[str, str] = {}
    if add:
        env["LD_PRELOAD"] = ":".join(add + preload)
    if "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = str(threads or physical_cores())
    if iomp and (iomp in add or any("libiomp" in p for p in preload)):
        # vLLM's own settings for Intel OpenMP worker threads (utils/ompmultiprocessing.py).
        env.setdefault("KMP_BLOCKTIME", environ.get("KMP_BLOCKTIME", "5"))
        env.setdefault("KMP_TPAUSE", environ.get("KMP_TPAUSE", "0"))
    return {k: v for k, v in env.items() if environ.get(k) != v}


def apply_in_place(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the variables that work without a restart (everything but LD_PRELOAD)."""
    environ = os.environ if environ is None else environ
    env = recommended_env(environ)
    env.pop("LD_PRELOAD", None)
    environ.update(env)
    return env


def reexec_with_speed_env(argv: list[str], module: str = "vllm_specdiff.cli") -> None:
    """Re-run `python -P -m MODULE argv` with the recommended settings, once (the CLI, or a
    benchmark script run as `python benchmarks/X.py`).

    Returns without doing anything when they are already in place (or were applied before).
    """
    if os.environ.get(APPLIED_FLAG):
        return
    env = dict(os.environ)
    changes = recommended_env(env)
    env[APPLIED_FLAG] = "1"
    if "LD_PRELOAD" not in changes:
        os.environ[APPLIED_FLAG] = "1"
        os.environ.update(changes)
        return
    env.update(changes)
    sys.stdout.flush()
    sys.stderr.flush()
    # -P: `-m` would otherwise put the working directory first on sys.path, and run from this
    # repository that shadows installed packages with its folders (e.g. triton_kernels/).
    os.execve(sys.executable, [sys.executable, "-P", "-m", module, *argv], env)


def describe(environ: Mapping[str, str] | None = None) -> str:
    """One line saying which speed settings are active (printed by the CLI at start-up)."""
    environ = os.environ if environ is None else environ
    preload = environ.get("LD_PRELOAD", "")
    parts = [
        f"tcmalloc={'on' if 'libtcmalloc' in preload else 'off'}",
        f"iomp={'on' if 'libiomp' in preload else 'off'}",
        f"OMP_NUM_THREADS={environ.get('OMP_NUM_THREADS', 'unset')}",
    ]
    return "speed settings: " + ", ".join(parts)
