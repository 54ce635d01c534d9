"""Acceptance rules: exact greedy cases, and statistical losslessness with negative controls.

Statistical tests: vocabulary 8, draft window 2, random verifier p(. | path) and a drafter q that
differs from it; 20,000 independent one-step trials per rule (batched), each completed to two
tokens by plain sampling when the step emitted only one (the next step would start afresh). The
joint of the first two tokens is compared with p(x1) p(x2 | x1) by a chi-square test. A rule
passes if the p-value exceeds 1e-3; each negative control (a deliberately biased rule) must be
rejected with p-value below 1e-6. Seeds are fixed, so outcomes are deterministic.

The bonus token (emitted after all G drafts are accepted) is tested on its own: over the trials
that accepted both drafts, the bonus must follow p(. | x1, x2); the negative control draws it
from the last draft position's p (an off-by-one in the target rows).
"""

import pytest
import torch
from scipy.stats import chi2, chisquare

from vllm_specdiff.core.acceptance import (
    path_probs,
    verify_greedy,
    verify_point_mass,
    verify_standard,
    verify_tree,
)
from vllm_specdiff.core.best_first import best_first_tree
from vllm_specdiff.core.sampling import sample_drafts
from vllm_specdiff.core.scoring import score_drafts
from vllm_specdiff.core.tree import TokenTree, build_token_tree
from vllm_specdiff.core.trie import best_first_trie

V, G, K, TRIALS = 8, 2, 4, 20_000
PASS_P, REJECT_P = 1e-3, 1e-6


class ToyVerifier:
    """p(. | path) for paths of length <= 2 after a fixed context, from random Dirichlet tables."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        dirichlet = torch.distributions.Dirichlet(torch.full((V,), 0.6))
        torch.manual_seed(seed)
        self.root = dirichlet.sample()
        self.after1 = dirichlet.sample((V,))
        self.after2 = dirichlet.sample((V, V))
        self.q = torch.softmax(torch.randn(G, V, generator=gen) * 1.5, dim=-1)

    def with_matching_drafter(self) -> "ToyVerifier":
        """q = the verifier's own per-position marginals, so most drafts are fully accepted and
        the bonus token is emitted often (power for its test)."""
        self.q = torch.stack([self.root, self.root @ self.after1])
        return self

    def node_probs(self, tree: TokenTree) -> torch.Tensor:
        parent_token = tree.tokens[tree.parents.clamp_min(0)]
        by_depth = [self.root.expand(tree.num_nodes, V), self.after1[tree.tokens],
                    self.after2[parent_token, tree.tokens]]
        out = torch.zeros(tree.num_nodes, V)
        for depth, probs in enumerate(by_depth):
            out[tree.depths == depth] = probs[tree.depths == depth]
        return out

    def joint(self) -> torch.Tensor:
        return (self.root.unsqueeze(1) * self.after1).reshape(-1)


def _first_two(verifier: ToyVerifier, tokens: torch.Tensor, num_accepted: torch.Tensor,
               gen: torch.Generator) -> torch.Tensor:
    first = tokens[:, 0]
    second = tokens[:, 1].clone()
    short = num_accepted == 0
    second[short] = torch.multinomial(verifier.after1[first[short]], 1, generator=gen).squeeze(1)
    return first * V + second


def _chi2_pvalue(verifier: ToyVerifier, cells: torch.Tensor) -> float:
    observed = torch.bincount(cells, minlength=V * V).double()
    expected = verifier.joint().double() * TRIALS
    keep = expected >= 5
    obs = torch.cat([observed[keep], observed[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def _draft_tree(verifier: ToyVerifier, num_drafts: int, gen: torch.Generator):
    marginals = verifier.q.unsqueeze(0).expand(TRIALS, G, V)
    drafts = sample_drafts(marginals, num_drafts, gen)
    tree = build_token_tree(torch.zeros(TRIALS, dtype=torch.long), drafts)
    return drafts, tree, verifier.node_probs(tree)


def _selected(drafts, tree, node_probs):
    selected = score_drafts(node_probs.log(), tree, 1.0).selected
    return selected, drafts[torch.arange(TRIALS), selected], path_probs(node_probs, tree, selected)


def run_point_mass(verifier, gen):
    drafts, tree, node_probs = _draft_tree(verifier, K, gen)
    _, chosen, target = _selected(drafts, tree, node_probs)
    return verify_point_mass(target, chosen, gen)


def run_tree(verifier, gen):
    _, tree, node_probs = _draft_tree(verifier, K, gen)
    return verify_tree(node_probs, tree, gen)


def run_standard(verifier, gen):
    drafts, tree, node_probs = _draft_tree(verifier, 1, gen)
    target = path_probs(node_probs, tree, torch.zeros(TRIALS, dtype=torch.long))
    q = verifier.q.unsqueeze(0).expand(TRIALS, G, V)
    return verify_standard(target, drafts[:, 0], q, gen)


def biased_selected_then_standard(verifier, gen):
    """Negative control from the issue: select by tau, commit with min(1, p/q)."""
    drafts, tree, node_probs = _draft_tree(verifier, K, gen)
    _, chosen, target = _selected(drafts, tree, node_probs)
    q = verifier.q.unsqueeze(0).expand(TRIALS, G, V)
    return verify_standard(target, chosen, q, gen)


def _best_first_tries(verifier: ToyVerifier, budget: int):
    """The best-first trie of `budget` nodes grown from q (one per trial: q is fixed), batched
    into one TokenTree of TRIALS requests, and its node probabilities."""
    trie = best_first_trie(0, best_first_tree(verifier.q.log(), budget))
    assert trie.lengths is not None and len(set(trie.lengths.tolist())) > 1  # depths differ
    n = trie.num_nodes
    shift = (torch.arange(TRIALS) * n).unsqueeze(1)
    parents = torch.where(trie.parents >= 0, trie.parents.unsqueeze(0) + shift, -1)
    tree = TokenTree(trie.tokens.repeat(TRIALS), parents.reshape(-1), trie.depths.repeat(TRIALS),
                     torch.arange(TRIALS + 1) * n, (trie.draft_nodes.unsqueeze(0)
                                                   + shift.unsqueeze(2)),
                     trie.tokens[trie.draft_nodes].expand(TRIALS, -1, -1))
    return tree, verifier.node_probs(tree)


def run_tree_best_first(verifier, gen):
    tree, node_probs = _best_first_tries(verifier, 4)
    return verify_tree(node_probs, tree, gen)


def biased_tree_emitting_from_full_p(verifier, gen):
    """Negative control: the tree walk, but after rejecting every child it emits from the full p
    instead of p with the rejected children removed (a classic residual bug)."""
    _, tree, node_probs = _draft_tree(verifier, K, gen)
    return _walk_emitting_from_full_p(tree, node_probs, gen)


def biased_best_first_emitting_from_full_p(verifier, gen):
    """The same bug on best-first tries (candidates of different lengths)."""
    tree, node_probs = _best_first_tries(verifier, 4)
    return _walk_emitting_from_full_p(tree, node_probs, gen)


def _walk_emitting_from_full_p(tree, node_probs, gen):
    children = [[] for _ in range(tree.num_nodes)]
    for node, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            children[parent].append(node)
    tokens = torch.full((TRIALS, G + 1), -1, dtype=torch.long)
    accepted = torch.zeros(TRIALS, dtype=torch.long)
    coins = torch.rand(TRIALS, G + 1, tree.num_drafts, generator=gen)
    for r, root in enumerate(tree.root_nodes().tolist()):
        node, depth = root, 0
        while True:
            remaining = node_probs[node].clone()
            nxt = -1
            for rank, child in enumerate(children[node]):
                tok = int(tree.tokens[child])
                if coins[r, depth, rank] < remaining[tok] / remaining.sum():
                    nxt = child
                    break
                remaining[tok] = 0
            if nxt < 0:
                tokens[r, depth] = torch.multinomial(node_probs[node], 1, generator=gen)
                break
            tokens[r, depth] = tree.tokens[nxt]
            node, depth = nxt, depth + 1
        accepted[r] = depth
    return type("V", (), {"tokens": tokens, "num_accepted": accepted})


def biased_standard_misreported_q(verifier, gen):
    """Negative control: standard rule told the drafts came from a uniform q."""
    drafts, tree, node_probs = _draft_tree(verifier, 1, gen)
    target = path_probs(node_probs, tree, torch.zeros(TRIALS, dtype=torch.long))
    uniform = torch.full((TRIALS, G, V), 1.0 / V)
    return verify_standard(target, drafts[:, 0], uniform, gen)


@pytest.mark.parametrize("rule", [run_point_mass, run_tree, run_standard, run_tree_best_first])
@pytest.mark.parametrize("seed", [0, 1])
def test_rule_is_lossless(rule, seed):
    verifier = ToyVerifier(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    verdict = rule(verifier, gen)
    pvalue = _chi2_pvalue(verifier, _first_two(verifier, verdict.tokens, verdict.num_accepted, gen))
    assert pvalue > PASS_P, f"{rule.__name__}: p-value {pvalue:.2e}"


@pytest.mark.parametrize("rule", [biased_selected_then_standard,
                                  biased_tree_emitting_from_full_p,
                                  biased_best_first_emitting_from_full_p,
                                  biased_standard_misreported_q])
def test_negative_control_is_rejected(rule):
    verifier = ToyVerifier(0)
    gen = torch.Generator().manual_seed(100)
    verdict = rule(verifier, gen)
    pvalue = _chi2_pvalue(verifier, _first_two(verifier, verdict.tokens, verdict.num_accepted, gen))
    assert pvalue < REJECT_P, f"{rule.__name__}: p-value {pvalue:.2e} (bias not detected)"


def _bonus_pvalue(verifier: ToyVerifier, verdict) -> tuple[float, int]:
    """Chi-square of the bonus given its path (x1, x2), over fully accepted trials: one
    goodness-of-fit test per path against p(. | x1, x2), rare bonus tokens merged, statistics
    and degrees of freedom summed. Also returns the number of fully accepted trials."""
    full = verdict.num_accepted == G
    x1, x2, bonus = verdict.tokens[full].unbind(1)
    counts = torch.bincount((x1 * V + x2) * V + bonus, minlength=V ** 3).view(V * V, V).double()
    statistic, dof = 0.0, 0
    for path, observed in enumerate(counts):
        expected = observed.sum() * verifier.after2.reshape(V * V, V)[path].double()
        keep = expected >= 5
        obs = torch.cat([observed[keep], observed[~keep].sum().view(1)])
        exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
        if int((exp > 0).sum()) < 2:
            continue
        statistic += float(((obs - exp) ** 2 / exp.clamp_min(1e-12))[exp > 0].sum())
        dof += int((exp > 0).sum()) - 1
    return float(chi2.sf(statistic, dof)), int(full.sum())


def biased_bonus_from_last_draft_position(verifier, gen):
    """Negative control: point mass with the target's bonus row copied from the last draft
    position (an off-by-one in building the target rows)."""
    drafts, tree, node_probs = _draft_tree(verifier, K, gen)
    _, chosen, target = _selected(drafts, tree, node_probs)
    target = target.clone()
    target[:, G] = target[:, G - 1]
    return verify_point_mass(target, chosen, gen)


@pytest.mark.parametrize("rule", [run_point_mass, run_tree, run_standard])
def test_bonus_token_follows_p_after_the_full_draft(rule):
    verifier = ToyVerifier(0).with_matching_drafter()
    verdict = rule(verifier, torch.Generator().manual_seed(300))
    pvalue, full = _bonus_pvalue(verifier, verdict)
    assert full > 1000, f"only {full} fully accepted trials: too few for power"
    assert pvalue > PASS_P, f"{rule.__name__}: bonus p-value {pvalue:.2e}"


def test_bonus_token_negative_control_is_rejected():
    verifier = ToyVerifier(0).with_matching_drafter()
    verdict = biased_bonus_from_last_draft_position(verifier, torch.Generator().manual_seed(300))
    pvalue, full = _bonus_pvalue(verifier, verdict)
    assert full > 1000
    assert pvalue < REJECT_P, f"off-by-one bonus not detected: p-value {pvalue:.2e}"


def test_rejection_with_no_mass_left_emits_the_argmax_not_a_random_token():
    """p(x) = 0.5 is the row's only mass (a stand-in for p(x) ~ 1 after float rounding): a
    rejection leaves nothing to sample, and the emitted token must be x, p's argmax."""
    trials = 400
    target = torch.zeros(trials, 2, V)
    target[:, 0, 3] = 0.5
    target[:, 1] = 1.0 / V
    drafts = torch.full((trials, 1), 3)
    verdict = verify_point_mass(target, drafts, torch.Generator().manual_seed(0))
    rejected = verdict.num_accepted == 0
    assert 100 < int(rejected.sum()) < 300
    assert verdict.tokens[rejected, 0].tolist() == [3] * int(rejected.sum())


def test_acceptance_rates_are_plausible():
    """Guard against a vacuous pass: the lossless rules must actually accept draft tokens."""
    verifier = ToyVerifier(0)
    gen = torch.Generator().manual_seed(7)
    for rule in (run_point_mass, run_tree, run_standard):
        verdict = rule(verifier, gen)
        assert 0.05 < verdict.num_accepted.float().mean() < G


def test_verify_greedy_exact():
    drafts = torch.tensor([[3, 4, 5], [3, 4, 5], [1, 4, 5]])
    argmax = torch.tensor([[3, 4, 5, 6], [3, 7, 5, 6], [3, 4, 5, 6]])
    verdict = verify_greedy(argmax, drafts)
    assert verdict.num_accepted.tolist() == [3, 1, 0]
    assert verdict.tokens.tolist() == [[3, 4, 5, 6], [3, 7, -1, -1], [3, -1, -1, -1]]
    assert verdict.token_lists() == [[3, 4, 5, 6], [3, 7], [3]]


def _one_hot(index: list[list[int]], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(index), vocab).float()


def test_point_mass_and_standard_with_one_hot_target_equal_greedy():
    drafts = torch.tensor([[3, 4, 5], [3, 4, 5], [1, 4, 5]])
    argmax = [[3, 4, 5, 6], [3, 7, 5, 6], [3, 4, 5, 6]]
    target = _one_hot(argmax, 8)
    greedy = verify_greedy(torch.tensor(argmax), drafts)
    q = torch.full((3, 3, 8), 1 / 8)
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        assert torch.equal(verify_point_mass(target, drafts, gen).tokens, greedy.tokens)
        assert torch.equal(verify_standard(target, drafts, q, gen).tokens, greedy.tokens)


def test_tree_greedy_follows_argmax_path_through_any_branch():
    drafts = torch.tensor([[[1, 2], [1, 3], [4, 5]]])
    tree = build_token_tree(torch.tensor([0]), drafts)
    # argmax after root = 1, after (1) = 3, after (1, 3) = 6
    argmax_of = {(): 1, (1,): 3, (1, 2): 0, (1, 3): 6, (4,): 0, (4, 5): 0}
    paths = {0: ()}
    for k in range(3):
        for j in range(2):
            paths[int(tree.draft_nodes[0, k, j])] = tuple(drafts[0, k, : j + 1].tolist())
    probs = _one_hot([[argmax_of[paths[n]] for n in range(tree.num_nodes)]], 8)[0]
    verdict = verify_tree(probs, tree, torch.Generator().manual_seed(0))
    assert verdict.tokens.tolist() == [[1, 3, 6]]
    assert verdict.num_accepted.tolist() == [2]
    assert verdict.accepted_nodes.tolist() == [[int(tree.draft_nodes[0, 1, 0]),
                                                int(tree.draft_nodes[0, 1, 1])]]


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match=r"\[B, G\+1\]"):
        verify_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
