"""The conditioned drafter's per-request context cache: amortised appends, batching, the byte
bound with retired entries, and reuse of a prompt prefix vLLM's prefix cache skipped."""

import pytest
import torch

from vllm_specdiff.drafter.conditioned import ConditionedConfig, ConditionedDrafter
from vllm_specdiff.drafter.conditioned_state import ConditionedContextCache

H, TAPS, VOCAB, GAMMA = 32, (0, 1), 96, 4


@pytest.fixture(scope="module")
def drafter():
    cfg = ConditionedConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, intermediate_size=64, vocab_size=VOCAB,
                            target_layer_ids=TAPS, num_hidden_layers=2, block_size=GAMMA + 1,
                            max_position_embeddings=128, verifier_num_layers=3)
    torch.manual_seed(0)
    model = ConditionedDrafter(cfg)
    with torch.no_grad():  # large weights: every context position visibly moves the logits
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.normal_(1, 0.1)
    return model.eval()


def _seq(seed: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [length] and their (stand-in) verifier features [length, taps*H]."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (length,), generator=gen),
            torch.randn(length, H * len(TAPS), generator=gen))


def _teacher_forced(drafter, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """Block logits [gamma, V] with the whole context projected at once (anchor: ids[-1])."""
    n = ids.shape[0]
    return drafter.window_logits(ids[None], torch.tensor([[n]]), GAMMA, feats[None])[0, 0]


def _feed(cache, req_id: str, feats: torch.Tensor, lo: int, hi: int) -> None:
    """Feed positions lo..hi-1 one step at a time (as decode steps arrive)."""
    for p in range(lo, hi):
        cache.extend(req_id, feats[p:p + 1], p)


@torch.no_grad()
def test_appends_over_many_steps_equal_projecting_the_whole_context(drafter):
    ids, feats = _seq(0, 70)
    cache = ConditionedContextCache(drafter, max_backlog=0)  # projected every step
    cache.extend("r", feats[:6], 0)  # a prefill chunk, then single decode steps
    buffers = set()
    for p in range(6, 69):
        cache.extend("r", feats[p:p + 1], p)
        buffers.add(cache.entries["r"].kv.data_ptr())
    entry = cache.entries["r"]
    assert (entry.start, entry.end) == (0, 69)
    # amortised: the buffer doubled a few times (6 -> 12 -> 24 -> 48 -> 96), not once per step
    assert len(buffers) <= 4 and entry.kv.shape[3] == 96
    assert cache.nbytes == entry.kv.numel() * entry.kv.element_size()  # capacity, not length
    whole = drafter.context_kv(drafter.context(feats[None, :69]), torch.arange(69)[None])
    for layer, (k, v) in enumerate(whole):
        torch.testing.assert_close(entry.keys[layer], k[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(entry.values[layer], v[0], rtol=0, atol=1e-5)
    got = cache.block_logits(["r"], ids[68:69], [68], [ids[:69]])[0]
    torch.testing.assert_close(got, _teacher_forced(drafter, ids[:69], feats[:69]),
                               rtol=0, atol=1e-5)
    assert cache.restarts == 0 and cache.prefix_hits == 0
    # the token buffer grows the same way: recorded once, then only the new tail
    assert torch.equal(entry.tokens[:entry.num_tokens], ids[:69])


@torch.no_grad()
def test_a_batch_of_different_lengths_drafts_each_row_as_alone(drafter):
    lengths = {"a": 5, "b": 17, "c": 30, "d": 1}  # "d": a one-token prompt, an empty context
    seqs = {r: _seq(10 + i, n) for i, (r, n) in enumerate(lengths.items())}
    cache = ConditionedContextCache(drafter)
    for r, (ids, feats) in seqs.items():
        cache.extend(r, feats[:len(ids) - 1], 0)
    order = ["c", "a", "d", "b"]
    args = (torch.stack([seqs[r][0][-1] for r in order]), [lengths[r] - 1 for r in order],
            [seqs[r][0] for r in order])
    batch = cache.block_logits(order, *args)
    for i, r in enumerate(order):
        alone = cache.block_logits([r], args[0][i:i + 1], [args[1][i]], [args[2][i]])[0]
        torch.testing.assert_close(batch[i], alone, rtol=0, atol=1e-5)
        torch.testing.assert_close(alone, _teacher_forced(drafter, *seqs[r]), rtol=0, atol=1e-5)
    assert cache.restarts == 0


def _prefix_pair(shared: int, total: int, changed_at: int | None = None):
    """A finished request "a" and a new one "b" whose first `shared` tokens (and so features)
    equal a's; with changed_at, b's token there differs (the same features: only the token
    check can tell)."""
    ids_a, feats_a = _seq(20, total)
    ids_b, feats_b = _seq(21, total)
    ids_b[:shared], feats_b[:shared] = ids_a[:shared], feats_a[:shared]
    if changed_at is not None:
        ids_b[changed_at] = (ids_b[changed_at] + 1) % VOCAB
    return (ids_a, feats_a), (ids_b, feats_b)


def _run_a_then_b(drafter, shared: int, changed_at: int | None = None, drop_a: bool = True,
                  a_len: int = 30):
    """"a" prefills from 0, drafts twice, (finishes); "b" arrives with its first `shared`
    positions prefix-cached (features from `shared` on), decodes two steps, drafts."""
    (ids_a, feats_a), (ids_b, feats_b) = _prefix_pair(shared, 40, changed_at)
    cache = ConditionedContextCache(drafter)
    cache.extend("a", feats_a[:a_len - 2], 0)
    cache.block_logits(["a"], ids_a[a_len - 2:a_len - 1], [a_len - 2], [ids_a[:a_len - 1]])
    cache.extend("a", feats_a[a_len - 2:a_len - 1], a_len - 2)
    cache.block_logits(["a"], ids_a[a_len - 1:a_len], [a_len - 1], [ids_a[:a_len]])
    if drop_a:
        cache.drop("a")
        assert "a" in cache.retired and "a" not in cache.entries
    n = 24  # b's committed tokens at its first draft; the anchor is token n-1
    cache.extend("b", feats_b[shared:n - 2], shared)  # prefill of the uncached part
    _feed(cache, "b", feats_b, n - 2, n - 1)
    got = cache.block_logits(["b"], ids_b[n - 1:n], [n - 1], [ids_b[:n]])[0]
    return cache, got, _teacher_forced(drafter, ids_b[:n], feats_b[:n])


@torch.no_grad()
def test_a_prefix_cached_request_reuses_a_finished_requests_context(drafter):
    cache, got, want = _run_a_then_b(drafter, shared=16)
    assert (cache.prefix_hits, cache.restarts) == (1, 0)
    assert cache.entries["b"].start == 0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # as if fed from position 0


@torch.no_grad()
def test_a_prefix_cached_request_reuses_a_running_requests_context(drafter):
    cache, got, want = _run_a_then_b(drafter, shared=16, drop_a=False)
    assert (cache.prefix_hits, cache.restarts) == (1, 0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert cache.entries["a"].end == 29  # the donor is untouched


@torch.no_grad()
def test_no_reuse_when_a_prefix_token_differs_or_the_donor_is_short(drafter):
    cache, got, want = _run_a_then_b(drafter, shared=16, changed_at=3)
    assert (cache.prefix_hits, cache.restarts) == (0, 1)
    assert cache.entries["b"].start == 16  # drafted from its own positions only
    assert not torch.allclose(got, want, atol=1e-3)
    # a donor whose recorded span stops before b's first position does not qualify either
    cache, got, want = _run_a_then_b(drafter, shared=16, a_len=12)
    assert (cache.prefix_hits, cache.restarts) == (0, 1)
    assert not torch.allclose(got, want, atol=1e-3)


@pytest.mark.parametrize("max_backlog", [0, 64])
@torch.no_grad()
def test_positions_jumping_back_keep_the_requests_own_context(drafter, max_backlog):
    """Preemption with recomputation from a prefix-cache hit: the request's own K/V up to the
    new first position stay (same tokens), no restart; whether they were projected (cut back
    in the K/V) or still deferred (cut back in the backlog)."""
    ids, feats = _seq(30, 40)
    cache = ConditionedContextCache(drafter, max_backlog=max_backlog)
    cache.extend("r", feats[:20], 0)
    cache.extend("r", feats[8:25], 8)
    assert (cache.entries["r"].start, cache.entries["r"].fed_end) == (0, 25)
    got = cache.block_logits(["r"], ids[25:26], [25], [ids[:26]])[0]
    torch.testing.assert_close(got, _teacher_forced(drafter, ids[:26], feats[:26]),
                               rtol=0, atol=1e-5)
    assert cache.restarts == 0


@torch.no_grad()
def test_the_byte_bound_holds_with_retired_entries_which_go_first(drafter):
    ids, feats = _seq(40, 20)
    cache = ConditionedContextCache(drafter)
    for r in ("a", "b", "c"):
        cache.extend(r, feats[:10], 0)
        cache.block_logits([r], ids[10:11], [10], [ids[:11]])
    one = cache.entries["a"].nbytes
    cache.max_bytes = 3 * one  # room for three entries
    cache.drop("a")
    assert list(cache.retired) == ["a"] and cache.nbytes <= cache.max_bytes
    cache.extend("d", feats[:10], 0)  # four entries' bytes: one must go
    cache.block_logits(["d"], ids[10:11], [10], [ids[:11]])
    assert not cache.retired  # the retired "a" went, not the idle running "b"
    assert list(cache.entries) == ["b", "c", "d"] and cache.nbytes <= cache.max_bytes
    # retiring into a full store evicts retired entries (oldest first), never running ones
    cache.max_bytes = 3 * one - 1
    cache.drop("b")
    assert not cache.retired and cache.nbytes <= cache.max_bytes
    assert list(cache.entries) == ["c", "d"]
    # and the count of retired entries is bounded too
    cache = ConditionedContextCache(drafter, max_retired=2)
    for r in ("a", "b", "c"):
        cache.extend(r, feats[:10], 0)
        cache.block_logits([r], ids[10:11], [10], [ids[:11]])
        cache.drop(r)
    assert list(cache.retired) == ["b", "c"]
    # a request fed but never drafted has no recorded tokens: nothing to match, not retired
    cache.extend("e", feats[:10], 0)
    cache.drop("e")
    assert "e" not in cache.retired


@torch.no_grad()
def test_an_int8_drafter_serves_from_the_cache(drafter):
    import copy

    from vllm_specdiff.drafter.quantize import quantize_drafter

    quantized = quantize_drafter(copy.deepcopy(drafter), "int8")
    ids, feats = _seq(50, 30)
    cache = ConditionedContextCache(quantized)
    cache.extend("a", feats[:20], 0)
    _feed(cache, "a", feats, 20, 29)
    logits = cache.block_logits(["a"], ids[29:30], [29], [ids[:30]])
    assert logits.shape == (1, GAMMA, VOCAB) and torch.isfinite(logits).all()
    cache.drop("a")
    ids_b = ids.clone()
    ids_b[25:] = (ids_b[25:] + 1) % VOCAB
    cache.extend("b", feats[16:24], 16)
    logits = cache.block_logits(["b"], ids_b[24:25], [24], [ids_b[:25]])
    assert cache.prefix_hits == 1 and torch.isfinite(logits).all()


@torch.no_grad()
def test_a_batch_of_updates_projected_together_equals_each_request_fed_alone(drafter):
    """extend_many projects every request's new positions in one call (each with its own RoPE
    position); each request's K/V must be what feeding it alone gives."""
    seqs = {f"r{i}": _seq(40 + i, n) for i, n in enumerate((9, 23, 4))}
    alone, together = (ConditionedContextCache(drafter, max_backlog=0) for _ in range(2))
    for cut in ((0, 3), (3, 4), (4, 8)):  # a prefill chunk, then steps of 1 and 4 positions
        updates = [(r, feats[cut[0]:cut[1]], cut[0]) for r, (_, feats) in seqs.items()]
        for update in updates:
            alone.extend(*update)
        together.extend_many(updates)
    for r in seqs:
        a, b = alone.entries[r], together.entries[r]
        assert (a.start, a.end) == (b.start, b.end) == (0, 8 if len(seqs[r][0]) >= 8 else 4)
        torch.testing.assert_close(b.filled(), a.filled(), atol=1e-5, rtol=1e-5)
    # negative control: the rows' positions matter (RoPE), so one shifted position shows
    shifted = ConditionedContextCache(drafter, max_backlog=0)
    shifted.extend_many([("r0", seqs["r0"][1][:3], 1)])
    assert not torch.allclose(shifted.entries["r0"].filled(),
                              alone.entries["r0"].filled()[:, :, :, :3], atol=1e-3)


# ---- deferred projection: a request not drafted on a step keeps that step's features raw ----
PROMPTS = {"a": 6, "b": 9, "c": 12}  # prompt lengths
DRAFTS_AT = {"a": {0, 5, 9}, "b": {3, 9}, "c": {9}}  # the steps each request drafts at


def _decode_steps(cache, seqs, zero_backlog_of: str | None = None) -> list[torch.Tensor]:
    """Ten serving steps: step s feeds each request the positions committed since its last step
    (its prompt first, then one a step) and drafts the requests due (`DRAFTS_AT`), together.
    Returns each step's block logits. `zero_backlog_of`: before the last step, that request's
    deferred features are zeroed (the negative control)."""
    out = []
    for step in range(10):
        first = {r: 0 if step == 0 else p + step - 1 for r, p in PROMPTS.items()}
        cache.extend_many([(r, seqs[r][1][first[r]:p + step], first[r])
                           for r, p in PROMPTS.items()])
        if step == 9 and zero_backlog_of is not None:
            entry = cache.entries[zero_backlog_of]
            entry.backlog = [torch.zeros_like(piece) for piece in entry.backlog]
        due = [r for r in PROMPTS if step in DRAFTS_AT[r]]
        if due:  # r's committed tokens: prompt + step + 1; the anchor is the last
            ids = [seqs[r][0][:PROMPTS[r] + step + 1] for r in due]
            out.append(cache.block_logits(due, torch.stack([t[-1] for t in ids]),
                                          [t.shape[0] - 1 for t in ids], ids))
    return out


@torch.no_grad()
def test_a_context_deferred_over_steps_without_drafts_drafts_as_projected_every_step(drafter):
    """A request drafted only now and then keeps its new positions raw in between and projects
    them all in the drafting step's one call: its drafts are the same as with every step
    projected (float tolerance: one matrix product over other rows; argmax identical), and
    the same as the whole context projected at once. A backlog reaching `max_backlog` rows is
    projected at once (bounded memory). Negative control: zeroing the deferred rows of a request
    changes its draft, so the deferred rows are what the draft reads."""
    seqs = {r: _seq(60 + i, p + 10) for i, (r, p) in enumerate(PROMPTS.items())}
    eager = ConditionedContextCache(drafter, max_backlog=0)
    deferred, capped = ConditionedContextCache(drafter), ConditionedContextCache(drafter,
                                                                                 max_backlog=4)
    want = _decode_steps(eager, seqs)
    got = _decode_steps(deferred, seqs)
    assert eager.projections == 10 and deferred.projections == 4  # steps with drafts
    for step_want, step_got, step_capped in zip(want, got, _decode_steps(capped, seqs),
                                                strict=True):
        torch.testing.assert_close(step_got, step_want, rtol=0, atol=1e-5)
        torch.testing.assert_close(step_capped, step_want, rtol=0, atol=1e-5)
        assert torch.equal(step_got.argmax(-1), step_want.argmax(-1))
    # "c" drafted only at the last step: its 12-token prompt and 9 steps, projected once
    torch.testing.assert_close(got[-1][2], _teacher_forced(drafter, seqs["c"][0][:22],
                                                           seqs["c"][1][:22]), rtol=0, atol=1e-5)
    assert max(e.backlog_rows for e in capped.entries.values()) < 4
    assert capped.projected_rows == deferred.projected_rows == eager.projected_rows
    assert eager.restarts == deferred.restarts == capped.restarts == 0
    broken = _decode_steps(ConditionedContextCache(drafter), seqs, zero_backlog_of="b")[-1]
    assert torch.equal(broken[0], got[-1][0])  # "a" and "c" untouched
    assert not torch.equal(broken[1].argmax(-1), got[-1][1].argmax(-1))


@torch.no_grad()
def test_a_donor_lends_a_prefix_still_in_its_backlog(drafter):
    """A running request's last fed position may still be raw when another request needs it as
    prefix: the donor projects it first, and the borrower drafts as if fed from position 0."""
    ids, feats = _seq(70, 20)
    cache = ConditionedContextCache(drafter)
    cache.extend("a", feats[:10], 0)
    cache.block_logits(["a"], ids[10:11], [10], [ids[:11]])  # records a's tokens 0..10
    cache.extend("a", feats[10:11], 10)  # deferred
    assert cache.entries["a"].backlog_rows == 1
    cache.extend("b", feats[11:13], 11)  # b's first 11 positions were prefix-cached
    got = cache.block_logits(["b"], ids[13:14], [13], [ids[:14]])[0]
    assert (cache.prefix_hits, cache.restarts) == (1, 0)
    torch.testing.assert_close(got, _teacher_forced(drafter, ids[:14], feats[:14]),
                               rtol=0, atol=1e-5)
