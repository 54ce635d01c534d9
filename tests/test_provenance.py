"""vllm_specdiff/provenance.py: results name no folder of the machine that wrote them."""

from __future__ import annotations

from pathlib import Path

import vllm_specdiff
from vllm_specdiff.provenance import ABSOLUTE_PATH, path_roots, portable, provenance

ROOT = Path(vllm_specdiff.__file__).resolve().parents[1]  # the checkout (editable install)
ROOTS = [("/work/main", ""), ("/root/.cache/vllm-specdiff", "$SPECDIFF_CACHE_DIR"),
         ("/root", "~")]


def test_paths_under_a_root_become_portable_and_others_stay():
    text = ("/work/main/.venv/bin/specdiff-distill eval --data /root/.cache/vllm-specdiff/data/x"
            " --candidate a=/root/runs/a --json /work/main/out/r.json --out /srv/r.json"
            " 12 tokens/s http://host/x $SPECDIFF_CACHE_DIR/y ~/z /work/mainly")
    assert portable({"command": text, "/work/main/k": ["/work/main"]}, ROOTS) == {
        "command": (".venv/bin/specdiff-distill eval --data $SPECDIFF_CACHE_DIR/data/x"
                    " --candidate a=~/runs/a --json out/r.json --out /srv/r.json"
                    " 12 tokens/s http://host/x $SPECDIFF_CACHE_DIR/y ~/z /work/mainly"),
        "k": ["."]}


def test_the_pattern_finds_absolute_paths_and_nothing_else():
    assert ABSOLUTE_PATH.findall("LD_PRELOAD=/usr/lib/a.so:/opt/b.so x=/tmp/c 3/4 a/b") == [
        "/usr/lib/a.so", "/opt/b.so", "/tmp/c"]
    assert ABSOLUTE_PATH.findall("$SPECDIFF_CACHE_DIR/x ~/y https://h/p relative/z") == []


def test_this_machines_roots_are_the_checkout_the_cache_and_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDIFF_CACHE_DIR", str(tmp_path / "cache"))
    roots = dict(path_roots())
    assert roots[str(tmp_path / "cache")] == "$SPECDIFF_CACHE_DIR"
    assert roots[str(ROOT)] == ""
    assert portable(str(ROOT / "benchmarks" / "results")) == "benchmarks/results"
    assert portable(f"--drafter={tmp_path}/cache/drafters/d") == \
        "--drafter=$SPECDIFF_CACHE_DIR/drafters/d"


def test_provenance_writes_the_command_portably_and_libraries_by_name(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4:/v/libiomp5.so")
    prov = provenance([str(ROOT / "vllm_specdiff" / "cli.py"), "demo", "--output",
                       str(ROOT / "out" / "demo.json")])
    assert prov["command"] == "vllm_specdiff/cli.py demo --output out/demo.json"
    assert prov["speed_settings"]["LD_PRELOAD"] == "libtcmalloc.so.4:libiomp5.so"
