"""The installed distribution only claims names this project owns, and its layers import downward.

`triton_kernels` is Triton's own package (vLLM looks for it for MXFP4 MoE models), `training` and
`benchmarks` are names any environment may have: the folders install as `vllm_specdiff_*`.
The subprocesses run with -P from `/`, so the repo root is not on sys.path: what they import
is what the installed environment provides.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOREIGN = ("triton_kernels", "training", "benchmarks")
INSTALLED = {"vllm_specdiff": "vllm_specdiff", "vllm_specdiff_kernels": "triton_kernels",
             "vllm_specdiff_training": "training", "vllm_specdiff_benchmarks": "benchmarks"}


def _installed_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=300, check=False, cwd="/")


def test_installed_names_are_the_projects_own():
    code = ("import importlib.util as u, json; "
            f"print(json.dumps({{n: (u.find_spec(n) or None) and u.find_spec(n).origin "
            f"for n in {sorted(FOREIGN) + sorted(INSTALLED)!r}}}))")
    result = _installed_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    origins = json.loads(result.stdout)
    assert {name: origins[name] for name in FOREIGN} == dict.fromkeys(FOREIGN)
    for name, folder in INSTALLED.items():
        assert origins[name] == str(ROOT / folder / "__init__.py")


@pytest.mark.vllm
def test_vllm_starts_without_a_triton_kernels_import_error():
    # vLLM's MoE config imports `triton_kernels.matmul` at start-up when a package of that name
    # is importable, and logs "Failed to import Triton kernels" when it is not Triton's.
    code = ("import vllm.model_executor.layers.fused_moe.config\n"
            "from vllm.utils.import_utils import has_triton_kernels\n"
            "print(has_triton_kernels())\n")
    result = _installed_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"
    assert "Failed to import Triton kernels" not in result.stdout + result.stderr  # vLLM: stdout


def test_console_scripts_run_outside_the_checkout():
    for script in ("specdiff-distill", "vllm-specdiff"):
        result = subprocess.run([str(Path(sys.executable).with_name(script)), "--help"],
                                capture_output=True, text=True, timeout=300, check=False,
                                cwd="/")
        assert result.returncode == 0, f"{script}: {result.stderr[-2000:]}"
        assert "usage:" in result.stdout


def _package_folders() -> set[str]:
    """Installed name of every folder with an __init__.py under the four package roots."""
    names = set()
    for name, folder in INSTALLED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            names.add(".".join((name, *parts)))
    return names


def test_every_package_folder_is_in_the_wheel():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == _package_folders()
    assert config["package-dir"] == {k: v for k, v in INSTALLED.items() if k != v}


def _imported_top_modules(path: Path) -> set[str]:
    """Absolute imports of a source file, as dotted names (relative imports are skipped)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def _violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for module in _imported_top_modules(path):
            if module.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    return bad


def test_the_cli_never_imports_the_benchmarks_or_old_names():
    assert _violations("vllm_specdiff", ("benchmarks", "vllm_specdiff_benchmarks", *FOREIGN)) == []


def test_the_core_never_imports_the_kernels_package():
    assert _violations("vllm_specdiff/core", ("vllm_specdiff_kernels", "triton_kernels")) == []


def test_package_folders_import_each_other_by_installed_name():
    for folder in ("triton_kernels", "training", "benchmarks", "tests"):
        assert _violations(folder, FOREIGN) == [], folder
