"""`SpecDiffProposer`: the diffusion drafter as a vLLM 0.32 custom proposer.

vLLM loads it when `speculative_config.model` is the dotted path
`vllm_specdiff.SpecDiffProposer` (method "custom_class"): the runner constructs it with the
`VllmConfig`, calls `load_model(target_model)` once, then after every engine step
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`, one row per
batch slot, and verifies the returned drafts itself. It passes no draft probabilities, so vLLM's
rejection sampler treats each draft as a point mass: at temperature 0 it accepts while the draft
equals the argmax, at temperature > 0 it accepts x with probability p(x) and otherwise samples
from p with x removed, which is the paper's lossless rule (ALGORITHM.md section 3) for K = 1.

Rows carry no request ids and are reordered, preempted and finished between steps; the drafter's
KV pool therefore finds each row's cached context by longest common prefix, and is bounded.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from vllm_specdiff.core import SpecDecodeStats, draft_marginals, sample_drafts
from vllm_specdiff.plugin.config import (
    SpecDiffConfig,
    check_drafter_for,
    check_num_speculative_tokens,
    parse_specdiff_config,
)
from vllm_specdiff.plugin.cpu_fixes import fix_cpu_expand_kernel

# Tokens of context that identify a row between two steps (with its length) when counting how
# many drafts were accepted; a collision only merges two rows' identical counts.
_SIGNATURE_TOKENS = 8


def _logger() -> Any:  # noqa: ANN401
    from vllm.logger import init_logger

    return init_logger("vllm.specdiff")  # under "vllm", so vLLM's log handlers print it


def verifier_tokenizer(model_config: Any) -> Any:  # noqa: ANN401
    """vLLM's own tokenizer of the served model, whatever names it (a hub id, a local
    directory, a ModelScope id); None when vLLM skips tokenizer init. `model_config.tokenizer`
    is only a name, not necessarily a directory to read a vocabulary from."""
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(model_config)


class SpecDiffProposer:
    """Drafts `num_speculative_tokens` tokens per request with a masked-diffusion drafter (K=1).

    The drafter attribute is `self.drafter`, never `self.model`: vLLM's runner inspects
    `drafter.model` to decide how to treat a proposer.
    """

    def __init__(self, vllm_config: Any) -> None:  # noqa: ANN401
        spec = vllm_config.speculative_config
        self.gamma = check_num_speculative_tokens(
            None if spec is None else spec.num_speculative_tokens,
            "speculative_config.num_speculative_tokens")
        self.config: SpecDiffConfig = parse_specdiff_config(vllm_config.additional_config,
                                                            gamma=self.gamma)
        if fix_cpu_expand_kernel():
            _logger().info("SpecDiff: installed the fix for vLLM's CPU expand_kernel "
                           "(temperature > 0 verification)")
        model_config = vllm_config.model_config
        check_drafter_for(str(model_config.model), self.config.drafter)
        self.max_model_len = int(model_config.max_model_len)
        self.verifier_vocab_size = int(model_config.get_vocab_size())
        self.model_config = model_config
        max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        self.cache_size = self.config.cache_size or max(16, 2 * max_num_seqs)
        self.drafter: Any = None
        self.drafter_path: str | None = None
        self.generator: torch.Generator | None = None
        self.stats = SpecDecodeStats()
        self.propose_calls = 0
        self.drafted_rows = 0
        self.drafter_seconds = 0.0
        self._pending: dict[tuple[int, bytes], int] = {}
        self._lock = threading.Lock()
        self._last_log = time.monotonic()
        self._logged = (0, 0.0, 0)

    # ---- vLLM interface -------------------------------------------------------------------------
    def load_model(self, target_model: Any = None, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        """Load the drafter next to the verifier (vLLM calls this after loading the target)."""
        from vllm_specdiff.drafter import load_drafter

        device = torch.device("cpu")
        if isinstance(target_model, torch.nn.Module):
            param = next(target_model.parameters(), None)
            if param is not None:
                device = param.device
        path = self.config.drafter
        if path is None:
            from vllm_specdiff.models import prepare_drafter

            path = str(prepare_drafter())
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.drafter = load_drafter(
            path, lora=self.config.lora, dtype=dtype, device=device,
            context_window=self.config.context_window,
            verifier_vocab_size=self.verifier_vocab_size, cache_size=self.cache_size,
            verifier_tokenizer=verifier_tokenizer(self.model_config),
            cache_bytes=self.config.cache_bytes, quantize=self.config.quantize)
        self._check_positions()
        self.drafter_path = path
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(self.config.seed)
        _logger().info("SpecDiff drafter %s loaded (gamma=%d, T_d=%s, steps=%d, cache=%d)",
                       path, self.gamma, self.config.drafter_temperature, self.config.steps,
                       self.cache_size)

    def _check_positions(self) -> None:
        """Fail at start-up when long requests could never be drafted for.

        Rows whose context + gamma passes the drafter's positions (or max_model_len) get
        shorter drafts in `propose`; but past the drafter's last position no draft fits at all,
        so without a context window the drafter must cover max_model_len positions, and with
        one, context_window + gamma of them.
        """
        limit = int(self.drafter.max_positions)
        window = self.config.context_window
        if window is None and self.max_model_len > limit:
            raise ValueError(
                f"the drafter supports {limit} positions but max_model_len is "
                f"{self.max_model_len}: lower --max-model-len to at most {limit} (drafts get "
                f"shorter within {self.gamma} tokens of it) or set "
                f"additional_config['specdiff']['context_window'] <= {limit - self.gamma}")
        if window is not None and window + self.gamma > limit:
            raise ValueError(
                f"additional_config['specdiff']['context_window'] = {window} plus "
                f"num_speculative_tokens = {self.gamma} exceeds the drafter's {limit} positions")

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None,  # noqa: ANN401
                **kwargs: Any) -> list[list[int]]:  # noqa: ANN401
        """One draft per row whose request just sampled tokens; [] for the others.

        token_ids_cpu[i, :num_tokens_no_spec[i]] is row i's committed sequence (prompt plus
        output, the tokens sampled this step included).
        """
        if self.drafter is None:
            raise RuntimeError("SpecDiffProposer.propose called before load_model")
        start = time.perf_counter()
        num_rows = len(sampled_token_ids)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        rows, contexts, lengths = [], [], []
        accepted = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                continue  # partial prefill chunk or discarded request: nothing to extend
            n = int(num_tokens_no_spec[i])
            context = token_ids_cpu[i, :n]
            prev = self._pending.pop(self._signature(context[: n - len(sampled)]), None)
            if prev is not None:
                accepted.append(min(len(sampled) - 1, prev))
            room = min(self.gamma, self.max_model_len - n, self.drafter.draft_room(n))
            if room <= 0:
                continue
            rows.append(i)
            contexts.append(torch.from_numpy(np.asarray(context, dtype=np.int64)))
            lengths.append(room)
        self._pending.clear()  # rows not seen this step finished or were preempted
        if accepted:
            self.stats.record(accepted, self.gamma)
        if rows:
            tokens = self._draft(contexts, lengths)
            for i, context, room, draft in zip(rows, contexts, lengths, tokens, strict=True):
                drafts[i] = draft
                self._pending[self._signature(context.numpy())] = room
        elapsed = time.perf_counter() - start
        with self._lock:
            self.propose_calls += 1
            self.drafted_rows += len(rows)
            self.drafter_seconds += elapsed
        self._maybe_log()
        return drafts

    def _draft(self, contexts: list[torch.Tensor], lengths: list[int]) -> list[list[int]]:
        """`lengths[j]` draft tokens for context j. Rows near the position limit get shorter
        drafts than gamma; the drafter runs once per distinct length (once, away from it)."""
        out: list[list[int]] = [[] for _ in contexts]
        for length in sorted(set(lengths), reverse=True):
            group = [j for j, n in enumerate(lengths) if n == length]
            logits = self.drafter.draft_logits([contexts[j] for j in group], length,
                                               steps=min(self.config.steps, length))
            if self.config.drafter_temperature == 0:  # argmax drafts: skip one-hot marginals over V
                tokens = logits.argmax(-1).tolist()
            else:
                marginals = draft_marginals(logits, self.config.drafter_temperature,
                                            self.config.top_k)
                tokens = sample_drafts(marginals, 1, generator=self.generator)[:, 0].tolist()
            for j, draft in zip(group, tokens, strict=True):
                out[j] = draft
        return out

    # ---- metrics --------------------------------------------------------------------------------
    @staticmethod
    def _signature(context: np.ndarray) -> tuple[int, bytes]:
        tail = np.asarray(context[-_SIGNATURE_TOKENS:], dtype=np.int64)
        return int(context.shape[0]), tail.tobytes()

    def get_stats(self) -> dict[str, Any]:
        """Drafter time per step and acceptance, as the Python API and log line report them."""
        with self._lock:
            calls, rows, seconds = self.propose_calls, self.drafted_rows, self.drafter_seconds
        out = {
            "gamma": self.gamma,
            "drafter": self.drafter_path,
            "propose_calls": calls,
            "drafted_rows": rows,
            "drafter_seconds": seconds,
            "drafter_ms_per_step": 1000.0 * seconds / calls if calls else 0.0,
            "mean_accepted_length": self.stats.mean_accepted_length,
            "acceptance_rate": self.stats.acceptance_rate,
            "per_position_acceptance": self.stats.per_position_acceptance,
            "accepted_length_histogram": list(self.stats.accepted_length_histogram),
            "verify_steps": self.stats.steps,
        }
        if self.drafter is not None:
            out["drafter_cache"] = self.drafter.cache_stats()
            out["quantization"] = self.drafter.quantization
        return out

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = SpecDecodeStats()
            self.propose_calls = 0
            self.drafted_rows = 0
            self.drafter_seconds = 0.0
            self._logged = (0, 0.0, 0)

    def _maybe_log(self) -> None:
        interval = self.config.log_interval
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval:
            return
        self._last_log = now
        calls, seconds, steps = self.propose_calls, self.drafter_seconds, self.stats.steps
        d_calls = calls - self._logged[0]
        d_secs = seconds - self._logged[1]
        self._logged = (calls, seconds, steps)
        _logger().info(
            "SpecDiff drafter: %.1f ms/step (last %d steps), mean accepted length %.2f of %d "
            "(%d verify steps), cache %s",
            1000.0 * d_secs / max(d_calls, 1), d_calls, self.stats.mean_accepted_length,
            self.gamma, steps, self.drafter.cache_stats() if self.drafter is not None else {})
