"""What one runner (role "both") answers: the reference the split prefill/decode runners are held to."""

from __future__ import annotations


def reference(runner, reqs, state_after_prefill):
    """Every request of `reqs` through `runner` to its end: -> (token ids per request id, each
    request's state right after its prefill, as `state_after_prefill(runner, req_id)` reads it).
    The first step prefills every prompt (one chunk), as the runner is sized here."""
    for r in reqs:
        runner.add(r)
    want = {o.req_id: list(o.token_ids) for o in runner.step()}
    states = {r.id: state_after_prefill(runner, r.id) for r in reqs}
    while runner.num_running:
        for o in runner.step():
            want[o.req_id] += o.token_ids
    return want, states


def staged_transfer(prefill, decode, agents, arenas, req_id: str, src: tuple[int, list[int]], dst_row: int,
                    dst_region, nbytes: int) -> int:
    """A held request's state from the prefill runner into the decode runner, as the servers move
    it: gathered into a region of the prefill side's arena, that region and the metadata row
    written with one batched Mooncake write into `dst_region` and the decode row, then the held
    request and the region released. -> the number of entries the write had."""
    from specdeploy.engine.runtime.transfer import region_copies

    src_row, src_slots = src
    src_region = arenas[0].alloc(nbytes)
    prefill.gather_kv(src_slots, src_region)
    copies = [region_copies(src_region.data_ptr(), dst_region.data_ptr(), nbytes),
              prefill.metadata.row_copies(src_row, decode.metadata.row_addresses(dst_row))]
    srcs, dsts, lens = (sum((c[i] for c in copies), []) for i in range(3))
    assert agents[0].write(agents[1].session_id, srcs, dsts, lens) == sum(lens)
    prefill.release_held(req_id)
    arenas[0].release(src_region)
    return len(srcs)
