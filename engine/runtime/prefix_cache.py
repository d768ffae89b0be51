"""Prefix cache: a radix tree from token ids to the KV slots that already hold them.

The tree lives in the slot pool the plan sized (kv.py): a cached position is one slot, and that
slot holds the position's K/V in the target pool *and* in the draft pool (slots are shared by
the two models). Nothing else is cached: no logits, no hidden states.

What a slot holds, and so what its key must say
-----------------------------------------------
Target K/V at position i is a function of tokens 0..i. The draft's K/V at position i is not: a
draft entry pairs the token at i + 1 with the target's feature at i (EAGLE: the post-norm last
hidden state; EAGLE-3: three layers' states; MTP: the pre-norm state, all hc_mult streams of it
when hc_mult > 1), so it is a function of tokens 0..i+1. A slot written by a request whose token
i + 1 was x is wrong for a request that continues with y, although both share tokens 0..i. With a
draft head the tree is therefore keyed on *bigrams* (token i, token i + 1), one per position
(`lookahead = 1`, as SGLang does for EAGLE); target-only it is keyed on tokens (`lookahead = 0`).
A path of n keys covers positions 0..n-1 and, with a draft, n + 1 tokens.

What a hit gives the draft, and what it recomputes
--------------------------------------------------
A request matches at most `len(prompt) - 1` positions: the last prompt token is always run
through the target, because its logits give the first output token (sampled or greedy) and its
draft entry pairs with that token, which is not known before. Its prefill then starts at the
match length m: the target computes features for positions m..L-1, the draft extends over
entries m..L-1 (token i + 1, feature i) on top of the cached draft K/V of 0..m-1, and the carried
draft state after the last entry (`draft_hidden`) comes out of that extend as it does without a
hit. So for EAGLE, EAGLE-3 and MTP alike, hc_mult 1 or 4, the cached draft K/V of positions
0..m-1 is all the draft needs; the bigram key guarantees the entry at m - 1 was made with the
token at m that this request has. Nothing is dropped at block boundaries (vLLM drops the last
matched block with EAGLE) and no carried state is stored.

Every slot that enters the tree holds both models' K/V for its key: prefill writes the target's
K/V and the draft extend writes the draft's over the same slots; a speculative step commits only
the accepted path, whose target K/V comes from verify and whose draft K/V the draft extend over
that path rewrote with the true next token. Scratch and rejected tree slots never enter the tree.

Ownership and reference counts
------------------------------
A slot is free (SlotTable's stack), owned by one request, or owned by the tree. A request holds a
lock on the tree node where its cached prefix ends (`lock` counts along the path to the root),
so no running request's prefix is ever evicted; unlocked nodes are *evictable*. When a request
inserts its positions, those already in the tree keep the tree's slots and the request's copies
are freed (`insert` says how many were there); the rest are adopted. Eviction frees whole
unlocked leaves, least recently used first, until enough slots are free.

Requests that arrive together with one system prompt would all miss and compute it side by side;
the runner defers a request by one step when another in the same prefill chunk is writing at
least DEFER_MIN_TOKENS of the positions it would match, and it matches them the step after.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch
from specdeploy.engine.memory.kv import SlotTable

# Bigram key = (token_i << _BIGRAM_SHIFT) + token_{i+1}; vocabularies are far below 2**31.
_BIGRAM_SHIFT = 31
# Eviction frees at least capacity // _EVICT_FRACTION slots at a time.
_EVICT_FRACTION = 64
# A request waits a step when another in the same prefill chunk is writing at least this many
# positions it would match next step (the runner's _defer_for_cache).
DEFER_MIN_TOKENS = 32


class _Node:
    __slots__ = ("children", "key", "last_access", "lock_ref", "parent", "slots")

    def __init__(self, parent: _Node | None, key: list[int], slots: torch.Tensor):
        self.parent = parent
        self.children: dict[int, _Node] = {}   # by the first element of the child's key
        self.key = key                         # one key per position
        self.slots = slots                     # [len(key)] int64, the slots of those positions
        self.lock_ref = 0                      # requests whose cached prefix runs through here
        self.last_access = 0


@dataclass
class Match:
    node: _Node          # where the matched prefix ends (the root for no match): lock this
    slots: torch.Tensor  # [length] int64
    length: int


class PrefixCache:
    def __init__(self, table: SlotTable, lookahead: int):
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead must be 0 (target only) or 1 (with a draft), got {lookahead}")
        self.table = table
        self.lookahead = lookahead
        self._empty = torch.zeros(0, dtype=torch.int64, device=table.req_to_slot.device)
        self.root = _Node(None, [], self._empty)
        self.root.lock_ref = 1  # never evicted
        self._clock = 0
        self.evictable_slots = 0
        self.locked_slots = 0
        self.evicted_slots = 0   # since start (a counter for metrics)
        self.num_inserted = 0    # nodes added: a match older than this count may be stale

    @property
    def cached_slots(self) -> int:
        return self.evictable_slots + self.locked_slots

    def keys(self, tokens: list[int]) -> list[int]:
        """One key per position whose slot contents `tokens` determine: len(tokens) - lookahead.
        Keys of a longer sequence extend those of its prefix, so callers build them piecewise:
        keys(t[:m]) + keys(t[m - lookahead:])."""
        if self.lookahead == 0:
            return list(tokens)
        t = np.asarray(tokens, dtype=np.int64)
        return ((t[:-1] << _BIGRAM_SHIFT) + t[1:]).tolist()

    # ---- lookup and insertion ------------------------------------------------------------------

    def match(self, keys: list[int], max_positions: int) -> Match:
        """The longest cached prefix of `keys` (see keys()), at most max_positions positions."""
        node, pos, found = self._walk(keys[:max(max_positions, 0)])
        return Match(node, torch.cat(found) if len(found) > 1 else found[0] if found else self._empty, pos)

    def insert(self, keys: list[int], slots: torch.Tensor) -> tuple[int, Match]:
        """Cache positions 0..n-1 (n = len(keys)) held in slots[:n]. -> (how many leading
        positions were cached already, the match of all n). The tree keeps its own slots for the
        first `existed`, so the caller frees its copies of those (the ones it owns) and may use
        the match's slots instead; it gives up slots[existed:n] to the tree."""
        n = len(keys)
        if slots.numel() < n:
            raise ValueError(f"insert: {n} positions but {slots.numel()} slots")
        node, existed, found = self._walk(keys)
        if existed < n:
            child = _Node(node, keys[existed:], slots[existed:n].clone())
            child.last_access = self._tick()
            node.children[keys[existed]] = child
            self.evictable_slots += n - existed
            self.num_inserted += 1
            node = child
            found.append(child.slots)
        return existed, Match(node, torch.cat(found) if found else self._empty, n)

    def _walk(self, keys: list[int]) -> tuple[_Node, int, list[torch.Tensor]]:
        """Follow keys from the root, splitting a node where the match ends inside it.
        -> (deepest node whose whole path matched, positions matched, the slots on the way)."""
        node, pos, found = self.root, 0, []
        now = self._tick()
        node.last_access = now
        while pos < len(keys):
            child = node.children.get(keys[pos])
            if child is None:
                break
            common = _common_prefix(child.key, keys, pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            found.append(child.slots)
            pos += common
            node = child
        return node, pos, found

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut node's key after `at` positions; -> the new upper part (node keeps the rest)."""
        upper = _Node(node.parent, node.key[:at], node.slots[:at])
        upper.lock_ref = node.lock_ref  # every lock through node runs through its upper part
        upper.last_access = node.last_access
        upper.children[node.key[at]] = node
        node.parent.children[node.key[0]] = upper
        node.parent = upper
        node.key, node.slots = node.key[at:], node.slots[at:]
        return upper

    # ---- reference counts -------------------------------------------------------------------

    def lock(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_slots -= len(node.key)
                self.locked_slots += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("prefix cache: unlock without a matching lock")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_slots += len(node.key)
                self.locked_slots -= len(node.key)
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------

    def evict(self, num_slots: int) -> int:
        """Free at least num_slots slots (fewer if not that many are evictable) by dropping
        unlocked leaves, least recently used first; at least 1/64 of the pool, so that the walk
        over the tree is paid once per many allocations, not once per step. -> slots freed."""
        if num_slots <= 0:
            return 0
        num_slots = max(num_slots, self.table.capacity // _EVICT_FRACTION)
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_slots and heap:
            _, _, leaf = heapq.heappop(heap)
            self.table.free(leaf.slots)
            freed += len(leaf.key)
            self.evictable_slots -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.evicted_slots += freed
        return freed

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def check(self) -> None:
        """Recount everything from the tree (tests): sizes, lock counts, slot uniqueness."""
        evictable = locked = 0
        seen: list[torch.Tensor] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.parent is node and child.key and child.key[0] == first
                assert child.slots.numel() == len(child.key)
                assert child.lock_ref >= max((c.lock_ref for c in child.children.values()), default=0)
                if child.lock_ref:
                    locked += len(child.key)
                else:
                    evictable += len(child.key)
                seen.append(child.slots)
                stack.append(child)
        assert (evictable, locked) == (self.evictable_slots, self.locked_slots), \
            f"counted {(evictable, locked)}, tracked {(self.evictable_slots, self.locked_slots)}"
        if seen:
            slots = torch.cat(seen)
            assert slots.unique().numel() == slots.numel(), "a slot is cached twice"
            assert int(slots.min()) > 0, "the pad slot is cached"


def shared_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (list comparisons at C speed,
    halving the range: about log2(n) of them)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo + 1 < hi:           # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _common_prefix(key: list[int], keys: list[int], start: int) -> int:
    """How many leading elements of `key` equal keys[start:]."""
    n = min(len(key), len(keys) - start)
    if key[:n] == keys[start:start + n]:  # the usual case (a whole node matches), at C speed
        return n
    i = 0
    while i < n and key[i] == keys[start + i]:
        i += 1
    return i
