"""A runner's slot accounting, checked: no slot lost, none held twice (the prefix cache's tests and
the overlap tests check it at every step)."""

from __future__ import annotations

import torch

from specdeploy.engine.runtime.runner import Runner


def check_accounting(runner: Runner) -> None:
    """Every usable slot is exactly one of: free, cached, owned by a request (not cached), or
    taken by the next decode step, staged while this one ran (overlap) or launched ahead."""
    table, cache = runner.table, runner.prefix_cache
    owned = [runner.table.req_to_slot[s.row, s.cached:s.length] for s in runner._all_seqs() if s.row >= 0]
    free = table._stack[:table.num_free]
    parts = [free, *owned] + [step.slots.reshape(-1) for step in (runner._ahead, runner._in_flight) if step is not None]
    if cache is not None:
        cache.check()
        stack = [cache.root]
        while stack:
            node = stack.pop()
            parts.append(node.slots)
            stack.extend(node.children.values())
    everything = torch.cat(parts)
    assert everything.numel() == table.capacity, f"{everything.numel()} slots accounted, {table.capacity} exist"
    assert everything.unique().numel() == table.capacity, "a slot is held twice"
