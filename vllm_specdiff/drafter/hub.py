"""A drafter named by a hub id (`ORG/NAME`), as vLLM names models: resolved to a local snapshot.

Published DFlash drafters are known by their hub ids. A name that is no local path and looks
like one is fetched the way vLLM fetches a model (`huggingface_hub.snapshot_download`): from the
local Hugging Face cache when `HF_HUB_OFFLINE` is set or the hub cannot be reached, else
downloaded. Only configs, weights, the mask embedding and tokenizer files are fetched: code that
ships with a checkpoint is never downloaded, let alone run.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
FILES = ["*.json", "*.safetensors", "*.pt", "*.jinja", "*.txt", "*.model"]


def is_hub_id(name: str) -> bool:
    """`ORG/NAME` that names no local path."""
    return bool(HUB_ID.fullmatch(name)) and not Path(name).expanduser().exists()


def resolve_drafter(name: str) -> str:
    """`name` itself when it is a local path (or no hub id: the directory checks name what is
    wrong with it); a hub id's snapshot directory otherwise."""
    if not is_hub_id(name):
        return name
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, allow_patterns=FILES)
    except Exception as e:  # offline without a cached copy, unknown id, gated repo, ...
        raise FileNotFoundError(
            f"drafter {name!r} is no local directory, and as a hub id it could not be fetched "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); download it "
            f"first (`huggingface-cli download {name}`) or give a local directory") from None
