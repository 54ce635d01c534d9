"""`specdiff-distill datastore`: the verifier's own continuations of the training prompts as a
retrieval datastore file (`vllm_specdiff.core.datastore`), which the proposer's `datastore`
option drafts from where prompt lookup finds nothing.

Only the training split goes in (the prompts `train` holds out with the same fraction stay
out), so the trainer's held-out windows stay held out from retrieval too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_specdiff.core.datastore import Datastore

from .data import load_sequences, split_heldout


@dataclass
class DatastoreConfig:
    data: str  # data directories written by `generate` (comma list)
    output: str  # the datastore file (safetensors)
    heldout_fraction: float = 0.05  # the split `train` used: those prompts stay out


def run_datastore(cfg: DatastoreConfig) -> dict:
    train, held = split_heldout(load_sequences(cfg.data), cfg.heldout_fraction)
    store = Datastore.from_sequences(
        (train.sequence(i).numpy(), int(train.prompt_lens[i])) for i in range(len(train)))
    out = Path(cfg.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    store.save(out)
    return {"output": str(out), "sequences": len(train), "held_out_sequences": len(held),
            "continuation_tokens": len(store), "bytes": out.stat().st_size}
