"""Where a recipe's work lands, and the checks that need its verifier.

Everything a run writes is under `$SPECDIFF_CACHE_DIR/recipes/NAME` (NAME-smoke for `--smoke`,
so a smoke run never mixes with the real one): data/, runs/, drafters/ (each stage's last
checkpoint, exported), eval/, export/, and stages/ (one record per finished stage, what makes a
rerun skip it).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .fields import RecipeError
from .schema import DEFAULT_VERIFIER, VERIFIER_START, Recipe

MAX_PACKED_VOCAB = 2**16  # data_pack stores token ids as uint16
RECORD_WAIT_S = 24 * 3600.0  # how long the other ranks wait for rank 0's record of a stage
RECORD_POLL_S = 1.0


@dataclass
class Workspace:
    recipe: Recipe
    root: Path
    verifier: str
    smoke: bool = False

    @classmethod
    def open(cls, recipe: Recipe, smoke: bool = False, root: Path | None = None) -> Workspace:
        """The recipe's work directory and its verifier (the default one converted on first
        use), checked against the recipe."""
        from vllm_specdiff.models import cache_dir

        if recipe.verifier == DEFAULT_VERIFIER:
            from vllm_specdiff.models import prepare_verifier

            verifier = str(prepare_verifier())
        else:
            verifier = recipe.resolve(recipe.verifier)
        name = recipe.name + ("-smoke" if smoke else "")
        ws = cls(recipe, root or cache_dir() / "recipes" / name, verifier, smoke)
        ws.check_verifier()
        return ws

    # ---- paths ----------------------------------------------------------------------------------
    def data_dir(self, pack: str) -> Path:
        return self.root / "data" / pack

    def data_arg(self, packs: list[str]) -> str:
        """`--data` of several packs."""
        return ",".join(str(self.data_dir(p)) for p in packs)

    def run_dir(self, stage: str) -> Path:
        return self.root / "runs" / stage

    def stage_drafter(self, stage: Any) -> Path:
        """A stage's last checkpoint, exported (what later stages start from)."""
        return self.root / "drafters" / f"{stage.name}-{stage.steps}"

    def record(self, step: str) -> Path:
        return self.root / "stages" / (step.replace(":", "_") + ".json")

    # ---- records of finished stages -------------------------------------------------------------
    def done(self, step: str, key: str) -> dict | None:
        """The record of a stage finished with the same settings, else None."""
        path = self.record(step)
        if not path.is_file():
            return None
        saved = json.loads(path.read_text())
        return saved if saved.get("key") == key else None

    def write_record(self, step: str, key: str, outputs: dict, seconds: float) -> None:
        path = self.record(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # whole, for the ranks that wait for it
        tmp.write_text(json.dumps({"key": key, "outputs": outputs, "seconds": seconds},
                                  indent=2, default=str) + "\n")
        tmp.replace(path)

    def wait_for_record(self, step: str, key: str, timeout_s: float | None = None) -> dict:
        """Under torchrun, rank 0's record of a stage, polled until it is there: the other
        ranks go on only from what rank 0 made (torchrun ends them if rank 0 fails)."""
        deadline = time.monotonic() + (RECORD_WAIT_S if timeout_s is None else timeout_s)
        while (record := self.done(step, key)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 never recorded stage {step} ({self.record(step)}): "
                                   f"did it fail?")
            time.sleep(RECORD_POLL_S)
        return record

    # ---- checks that need the verifier ----------------------------------------------------------
    def check_verifier(self) -> None:
        """What only the verifier can tell: its depth against the taps, its chat template and
        vocabulary against the data the recipe makes."""
        from vllm_specdiff.drafter.checkpoint import read_config
        from vllm_specdiff.drafter.conditioned import spread_taps

        r, problems = self.recipe, []
        config = read_config(self.verifier)
        layers = int(config["num_hidden_layers"])
        taps = list(r.drafter.taps)
        spread = list(spread_taps(layers, len(taps))) if r.drafter.conditioned else taps
        if taps != spread and any(s.start == VERIFIER_START for s in r.stages):
            problems.append(f"drafter.taps: a new drafter reads {len(taps)} taps spread from "
                            f"layer 1 to {layers - 3} of this {layers}-layer verifier, {spread}; "
                            f"got {taps}")
        for i, s in enumerate(r.stages):
            if "/" in s.start and r.drafter.conditioned:
                have = list(read_config(r.resolve(s.start)).get("target_layer_ids", []))
                if have != taps:
                    problems.append(f"stages[{i}].start: that drafter reads taps {have}, the "
                                    f"recipe's drafter.taps are {taps}")
        generates = bool(r.packs_to_make()) or any(e.prompts for e in r.eval)
        if generates or r.generate.pack:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.verifier)
            if generates and r.generate.chat_template and not getattr(tok, "chat_template", None):
                problems.append(f"generate.chat_template: the verifier {self.verifier} has no "
                                f"chat template to wrap the prompts in")
            ids = max(len(tok), int(config.get("vocab_size", 0)))
            if r.generate.pack and ids > MAX_PACKED_VOCAB:
                problems.append(f"generate.pack: the verifier's {ids} token ids do not fit the "
                                f"packs' uint16")
        if problems:
            raise RecipeError(problems, f"recipe {r.name} with verifier {self.verifier}")


def digest(settings: Any) -> str:
    """A stage's settings, hashed: a rerun with other settings runs the stage again."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
