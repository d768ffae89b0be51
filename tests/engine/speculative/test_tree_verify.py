"""Tree building and verification as pure functions: table tests, and statistical tests that
rejection sampling reproduces the target distribution (chain with sampled drafts, tree with
top-k drafts)."""

import torch

from specdeploy.engine.speculative.tree import build_tree, chain_tree, expand_step, tree_from_parents
from specdeploy.engine.speculative.verify import verify_greedy, verify_sampling, warp_probs


def test_build_tree_keeps_best_paths_in_list_order():
    # step 0: two children of the root; step 1: each expanded into two.
    s0_tokens, s0_scores = torch.tensor([[10, 11]]), torch.tensor([[0.6, 0.3]])
    child_p = torch.tensor([[[0.5, 0.4], [0.9, 0.05]]])
    child_t = torch.tensor([[[20, 21], [22, 23]]])
    c_scores, c_tokens, c_parent, keep = expand_step(s0_scores, child_p, child_t, 2)
    assert torch.allclose(c_scores, torch.tensor([[0.3, 0.24, 0.27, 0.015]]))
    assert keep.tolist() == [[0, 2]]
    tree = build_tree(torch.tensor([7]), torch.cat([s0_tokens, c_tokens], 1),
                      torch.cat([s0_scores, c_scores], 1),
                      torch.cat([torch.tensor([[-1, -1]]), c_parent], 1), num_draft_tokens=5)
    # kept list entries 0 (10), 1 (11), 2 (20, tie with 11 broken by list order), 4 (22)
    assert tree.tokens.tolist() == [[7, 10, 11, 20, 22]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2]]
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2]]
    assert tree.children.tolist() == [[[1, 2], [3, -1], [4, -1], [-1, -1], [-1, -1]]]
    expected_mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                                  [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.mask[0], expected_mask)


def test_chain_tree_is_a_line():
    tree = chain_tree(torch.tensor([1, 2]), torch.tensor([[5, 6, 7], [8, 9, 3]]))
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] * 2
    assert torch.equal(tree.mask[0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_verify_greedy_walks_the_matching_branch():
    tree = tree_from_parents(torch.tensor([[7, 10, 11, 20, 22]]), torch.tensor([[-1, 0, 0, 1, 2]]))
    v = 30
    logits = torch.zeros(1, 5, v)
    logits[0, 0, 11] = 1   # root -> 11 (node 2)
    logits[0, 2, 22] = 1   # node 2 -> 22 (node 4)
    logits[0, 4, 3] = 1    # after the leaf: bonus 3
    path, num_acc, bonus = verify_greedy(tree, logits)
    assert path.tolist() == [[0, 2, 4]] and num_acc.tolist() == [2] and bonus.tolist() == [3]
    logits[0, 0, 11], logits[0, 0, 12] = 0, 2  # root predicts a token not in the tree
    path, num_acc, bonus = verify_greedy(tree, logits)
    assert path.tolist() == [[0, -1, -1]] and num_acc.tolist() == [0] and bonus.tolist() == [12]


def test_warp_probs_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4, 1)
    probs = warp_probs(logits, torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([0, 2, 0, 0]),
                       torch.tensor([1.0, 1.0, 0.7, 1.0]))
    assert torch.allclose(probs[0], torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(probs[1], torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(probs[2], torch.tensor([0.625, 0.375, 0, 0]))  # 0.5 < 0.7, 0.8 >= 0.7
    assert torch.equal(probs[3], torch.tensor([1.0, 0, 0, 0]))
    hot = warp_probs(logits[:1], torch.tensor([0.5]), torch.tensor([0]), torch.tensor([1.0]))
    assert torch.allclose(hot[0], torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365)


DRAWS = 40000
TOL = 0.015  # > 5 standard deviations of a frequency estimated from 40000 draws


def _freq(tokens: torch.Tensor, v: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=v).float() / max(len(tokens), 1)


def _dist(g, v, sharp=1.0):
    return torch.softmax(sharp * torch.randn(v, generator=g), -1)


def test_chain_sampling_matches_target_distribution():
    g = torch.Generator().manual_seed(0)
    v, depth = 6, 2
    p = torch.stack([_dist(g, v) for _ in range(depth + 1)])       # target at root, d1, d2
    q = torch.stack([_dist(g, v) for _ in range(depth)])           # draft proposals for d1, d2
    b = DRAWS
    drafts = torch.stack([torch.multinomial(q[i], b, replacement=True, generator=g)
                          for i in range(depth)], 1)               # [B, 2]
    tree = chain_tree(torch.zeros(b, dtype=torch.int64), drafts)
    target_probs = p.expand(b, -1, -1)
    draft_probs = torch.cat([torch.zeros(1, v), q]).expand(b, -1, -1)
    path, num_acc, bonus = verify_sampling(tree, target_probs, draft_probs,
                                           torch.rand(b, depth + 1, generator=g), torch.rand(b, generator=g))
    first = torch.where(num_acc >= 1, drafts[:, 0], bonus)
    assert 0.2 < (num_acc >= 1).float().mean() < 0.9
    assert (_freq(first, v) - p[0]).abs().max() < TOL
    # Given the first draft was accepted, the second token follows the target at node 1.
    two = num_acc >= 1
    second = torch.where(num_acc >= 2, drafts[:, 1], bonus)[two]
    assert (_freq(second, v) - p[1]).abs().max() < TOL * 1.5


def test_tree_sampling_with_topk_drafts_matches_target_distribution():
    """Root with three top-k children (deterministic proposals), each with two children."""
    g = torch.Generator().manual_seed(1)
    v = 7
    tokens = torch.tensor([0, 2, 5, 1, 3, 4, 0, 6, 5, 2])
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3])
    n = len(tokens)
    p = torch.stack([_dist(g, v, 1.5) for _ in range(n)])
    b = DRAWS
    tree = tree_from_parents(tokens.expand(b, n).contiguous(), parents.expand(b, n).contiguous())
    path, num_acc, bonus = verify_sampling(tree, p.expand(b, -1, -1), None,
                                           torch.rand(b, n, generator=g), torch.rand(b, generator=g))
    first_node = path[:, 1]
    first = torch.where(first_node >= 0, tokens[first_node.clamp(min=0)], bonus)
    assert 0.2 < (num_acc >= 1).float().mean() < 0.95
    assert (num_acc == 2).any()
    assert (_freq(first, v) - p[0]).abs().max() < TOL
    for node in (1, 2, 3):  # after accepting `node`, the next token follows p[node]
        at = first_node == node
        nxt = torch.where(path[:, 2] >= 0, tokens[path[:, 2].clamp(min=0)], bonus)[at]
        assert at.sum() > 2000
        assert (_freq(nxt, v) - p[node]).abs().max() < 0.03


def test_greedy_rows_are_exact_in_sampling_verify():
    """One-hot target distributions (temperature 0) make rejection sampling greedy."""
    tree = tree_from_parents(torch.tensor([[7, 10, 11, 20, 22]]), torch.tensor([[-1, 0, 0, 1, 2]]))
    logits = torch.randn(1, 5, 30)
    logits[0, 0, 11] = 9
    logits[0, 2, 22] = 9
    p = warp_probs(logits[0], torch.zeros(5), torch.zeros(5, dtype=torch.int64), torch.ones(5))
    path, num_acc, bonus = verify_sampling(tree, p[None], None, torch.rand(1, 5), torch.rand(1))
    g_path, g_acc, g_bonus = verify_greedy(tree, logits)
    assert torch.equal(path, g_path) and torch.equal(bonus, g_bonus)


def test_chain_fast_paths_equal_the_general_tree():
    """A chain (topk 1) is built from constants and verified without walking: the same tree and
    the same acceptance as the general construction and walk."""
    from dataclasses import replace
    g = torch.Generator().manual_seed(5)
    b, s, v = 256, 5, 2
    roots = torch.randint(0, v, (b,), generator=g)
    drafts = torch.randint(0, v, (b, s), generator=g)  # few tokens: every acceptance length occurs
    fast = chain_tree(roots, drafts)
    parents = (torch.arange(s + 1) - 1).expand(b, s + 1).contiguous()
    general = tree_from_parents(torch.cat([roots[:, None], drafts], 1), parents)
    assert fast.chain and not general.chain
    for name in ("tokens", "parents", "depth", "mask", "children"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    assert fast.max_depth == general.max_depth
    # build_tree hands the drafter's chain to chain_tree
    built = build_tree(roots, drafts, torch.ones(b, s), torch.arange(-1, s - 1).expand(b, s), s + 1, 1, s,
                       check=False)
    assert built.chain and torch.equal(built.tokens, fast.tokens)
    logits = torch.randn(b, s + 1, v, generator=g)
    got = verify_greedy(fast, logits)
    want = verify_greedy(replace(fast, chain=False), logits)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert set(got[1].tolist()) == set(range(s + 1))


def test_tree_climbed_by_generation_equals_node_by_node():
    """With the drafter's depth bound given, ancestors are climbed for that many generations
    only: the same mask as without the bound, and the depths computed by hand."""
    g = torch.Generator().manual_seed(9)
    b, n = 32, 12
    # Random trees, parents before children, depth at most 4.
    parents = torch.full((b, n), -1, dtype=torch.int64)
    depth = torch.zeros(b, n, dtype=torch.int64)
    for i in range(1, n):
        for r in range(b):
            choices = [j for j in range(i) if depth[r, j] < 4]
            parents[r, i] = choices[int(torch.randint(len(choices), (1,), generator=g))]
            depth[r, i] = depth[r, parents[r, i]] + 1
    tokens = torch.randint(0, 50, (b, n), generator=g)
    slow = tree_from_parents(tokens, parents)
    fast = tree_from_parents(tokens, parents, max_children=n, max_depth=4)
    assert torch.equal(fast.mask, slow.mask) and torch.equal(fast.depth, slow.depth)
    assert torch.equal(fast.depth, depth) and int(depth.max()) == 4


def test_greedy_tree_verification_equals_the_walk():
    """The vectorised greedy verification against the sibling-by-sibling walk, on random trees
    whose siblings may repeat a token (the walk takes the first)."""
    from specdeploy.engine.speculative import verify
    g = torch.Generator().manual_seed(13)
    b, n, v = 512, 10, 3
    parents = torch.full((b, n), -1, dtype=torch.int64)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (b,), generator=g)
    tree = tree_from_parents(torch.randint(0, v, (b, n), generator=g), parents)
    logits = torch.randn(b, n, v, generator=g)
    pred = logits.argmax(-1)
    rows = torch.arange(b)
    w_path, w_acc, w_last = verify._walk(tree, lambda cur, child, trying: tree.tokens[rows, child] == pred[rows, cur])
    path, acc, bonus = verify_greedy(tree, logits)
    assert torch.equal(path, w_path) and torch.equal(acc, w_acc) and torch.equal(bonus, pred[rows, w_last])
    assert int(acc.max()) >= 3  # deep acceptances occurred
