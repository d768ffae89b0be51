"""Tensor parallelism across processes: the ranks' lockstep and their processes.

One process per GPU (ranks 0..N-1 of one host, or of several pods: engine/runtime/group.py). Every rank holds a shard of each model and the
KV heads of its shard, and runs an identical Runner: the same requests, the same steps, the
same model calls in the same order, so the collectives inside the models (engine/parallel.py,
and inside the CUDA graphs that captured them) pair up without any per-call coordination. Rank 0
alone owns HTTP and the scheduler; before each step it broadcasts what changed since the last one
(requests added, requests aborted, settings), one pickle on the control group, and every other
rank applies the same changes and runs the same step (`follow`). This is SGLang's scheduler
design: the inputs are replicated, not the outputs. A split prefill/decode role's transfers are
such changes too (receive, release; docs/disaggregation.md): a KV gather or scatter is sent at
once, between steps, and the ranks' shares of the request's KV meet in rank 0's staging region
over the control group.

Why the ranks agree: every collective leaves the same bits on each rank (engine/parallel.py), and
everything after a collective is replicated work on identical inputs: the same logits, the same
argmax, the same draws from identically seeded generators. A rank that nevertheless diverges (a
nondeterministic kernel, a reduction whose order depends on the rank) would compute garbage
silently, so each step's broadcast carries a digest of rank 0's previous outputs and a rank whose
own outputs differ stops the server, naming the step.

Failure: a rank that dies takes the server down. Rank 0 watches its workers' process sentinels
in a thread; any exit it did not ask for logs the rank and its exit code, kills the other
workers and ends rank 0 with exit code 1, whatever rank 0 was doing (a collective waiting for
the dead rank included). Workers watch their parent the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import zlib

import torch
import torch.distributed as dist

from specdeploy.engine.parallel import TPGroup

log = logging.getLogger("specdeploy.engine.distributed")

# How often a worker checks that rank 0 (its parent) is alive.
PARENT_POLL_S = 1.0


def outputs_digest(outputs) -> int:
    """A checksum of one step's StepOutputs (what every rank must have produced alike)."""
    text = repr([(o.req_id, o.token_ids, o.num_accepted_drafts, o.finished) for o in outputs])
    return zlib.crc32(text.encode())


class Diverged(RuntimeError):
    """A rank's outputs differ from rank 0's."""


class LeaderRunner:
    """Rank 0's Runner under TP: the same interface (the scheduler cannot tell), plus the log of
    what changed since the last step, broadcast to the other ranks before each step runs.

    A step that fails on rank 0 cannot be undone on the ranks where it succeeded, so under TP a
    failed step is fatal (`on_fatal`; the launcher stops every rank and exits non-zero)."""

    def __init__(self, runner, tp: TPGroup, on_fatal):
        self.__dict__.update(runner=runner, tp=tp, on_fatal=on_fatal, _ops=[], _digest=None, _steps=0)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def __setattr__(self, name, value):
        if name != "prefill_chunk_tokens":
            raise AttributeError(f"{name}: set on the runner of every rank, not rank 0's alone")
        self.runner.prefill_chunk_tokens = value
        self._ops.append(("set", name, value))

    def add(self, req) -> None:
        self.runner.add(req)          # refused requests raise here and are never sent
        self._ops.append(("add", req))

    def abort(self, req_id: str) -> None:
        self.runner.abort(req_id)
        self._ops.append(("abort", req_id))

    # ---- prefill/decode disaggregation (docs/disaggregation.md): every rank holds its shard of
    # a request's KV, so what moves it runs on every rank. Only rank 0 talks to the peer server:
    # its staging region holds every rank's share, rank after rank (staged_kv), which the other
    # ranks send to it (gather_held) or receive from it (activate) over the control group, each
    # rank reading its own slots of the request.

    def receive(self, req):
        out = self.runner.receive(req)    # refused requests raise here and are never sent
        self._ops.append(("receive", req))
        return out

    def release_held(self, req_id: str) -> None:
        self.runner.release_held(req_id)
        self._ops.append(("release_held", req_id))

    def staged_kv(self, n: int):
        """Every rank's share of n tokens' rows, rank after rank (the ranks' shares are alike)."""
        return stacked_layout(self.runner.staged_kv(n), self.tp.size)

    def gather_held(self, req_id: str, region: torch.Tensor) -> None:
        """Every rank gathers its share of a held request's rows (from its own slots) and sends it
        to rank 0's region."""
        self._now([("gather", req_id)])
        with self._fatal_on_error("gather"):
            shares = self._shares(region, self.runner.staged_kv(len(self.runner.held_slots(req_id))).nbytes)
            self.runner.gather_held(req_id, shares[0])
            for rank in range(1, self.tp.size):
                dist.recv(shares[rank], src=rank, group=self.tp.control_group)

    def activate(self, req_id: str, staged: torch.Tensor | None = None):
        if staged is None:
            raise ValueError("under tensor parallelism a request's KV arrives only through a staging region")
        self.runner.check_arrived(req_id)  # a bad row fails this request, not the ranks
        seq = self.runner._receiving[req_id]
        self._now([("activate", req_id, self.runner.metadata.row_values(seq.row))])
        with self._fatal_on_error("activation"):
            shares = self._shares(staged, self.runner.staged_kv(seq.length).nbytes)
            for rank in range(1, self.tp.size):
                dist.send(shares[rank], dst=rank, group=self.tp.control_group)
            return self.runner.activate(req_id, shares[0])

    def _shares(self, region: torch.Tensor, nbytes: int) -> list[torch.Tensor]:
        return list(region[:nbytes * self.tp.size].view(self.tp.size, nbytes).unbind(0))

    def _now(self, ops: list) -> None:
        """Send what changed so far and `ops` to the other ranks at once (between steps)."""
        pending, self.__dict__["_ops"] = self._ops, []
        with self._fatal_on_error("control broadcast"):
            self.tp.broadcast(pending + ops)

    @contextlib.contextmanager
    def _fatal_on_error(self, what: str):
        """Once the other ranks have an op, rank 0 must do its part of it or stop the server:
        they would wait for it forever."""
        try:
            yield
        except BaseException as e:
            self.on_fatal(f"tensor-parallel {what} failed on rank 0 ({type(e).__name__}: {e}); "
                          "the ranks can no longer agree")
            raise

    def step(self):
        ops, self.__dict__["_ops"] = self._ops, []
        ops.append(("step", self._steps, self._digest))
        try:
            self.tp.broadcast(ops)
            outputs = self.runner.step()
        except BaseException as e:
            self.on_fatal(f"tensor-parallel step {self._steps} failed on rank 0 "
                          f"({type(e).__name__}: {e}); the ranks can no longer agree")
            raise
        self.__dict__["_digest"] = outputs_digest(outputs)
        self.__dict__["_steps"] = self._steps + 1
        return outputs

    def close(self) -> None:
        """Tell the other ranks to exit (after the last step)."""
        self.tp.broadcast([("exit",)])


def stacked_layout(layout, size: int):
    """A staging layout (transfer.StagedKV) of one rank's share, repeated for `size` ranks."""
    from specdeploy.engine.runtime.transfer import StagedKV

    return layout if size == 1 else StagedKV(layout.pieces * size, paired=False)


def agree_on_shapes(runner, tp: TPGroup) -> None:
    """An adaptive runner under TP decodes in rank 0's choice of shape: each step's choice is one
    more pickle on the control group (the other ranks' own choices, from their own timings, are
    dropped)."""
    if getattr(runner, "policy", None) is not None:
        runner.agree_shape = tp.broadcast


def follow(runner, tp: TPGroup) -> None:
    """A worker rank's loop: apply rank 0's changes and run its steps, until told to exit.
    Raises Diverged when this rank's outputs differ from rank 0's."""
    digest = None
    with torch.inference_mode():
        while True:
            for op in tp.broadcast():
                kind = op[0]
                if kind == "exit":
                    return
                if kind == "add":
                    runner.add(op[1])
                elif kind == "abort":
                    runner.abort(op[1])
                elif kind == "set":
                    setattr(runner, op[1], op[2])
                elif kind == "receive":
                    runner.receive(op[1])
                elif kind == "release_held":
                    runner.release_held(op[1])
                elif kind == "gather":
                    share = torch.empty(runner.staged_kv(len(runner.held_slots(op[1]))).nbytes, dtype=torch.uint8)
                    runner.gather_held(op[1], share)
                    dist.send(share, dst=0, group=tp.control_group)
                elif kind == "activate":
                    _, req_id, row_values = op
                    seq = runner._receiving[req_id]
                    runner.metadata.set_row_values(seq.row, row_values)
                    share = torch.empty(runner.staged_kv(seq.length).nbytes, dtype=torch.uint8)
                    dist.recv(share, src=0, group=tp.control_group)
                    runner.activate(req_id, share)
                elif kind == "step":
                    _, step, leader_digest = op
                    if leader_digest is not None and leader_digest != digest:
                        raise Diverged(f"rank {tp.rank}: outputs of step {step - 1} differ from rank 0's")
                    digest = outputs_digest(runner.step())
                else:
                    raise ValueError(f"unknown control op {kind!r}")


# ---- processes --------------------------------------------------------------------------------


class Workers:
    """Ranks 1..N-1 as child processes of rank 0 (torch.multiprocessing, spawn), and the watchdog
    that ends rank 0 when one of them dies."""

    def __init__(self, target, size: int, args_for_rank, on_death=None, ranks: range | None = None):
        """target(rank, *args_for_rank(rank)) runs in each child, one per rank of `ranks`
        (default 1..size-1; across pods, the ranks of this pod but its first)."""
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.size = size
        self.ranks = ranks if ranks is not None else range(1, size)
        self._stopping = False
        self._on_death = on_death or _die
        self.procs = []
        for rank in self.ranks:
            p = ctx.Process(target=target, args=(rank, *args_for_rank(rank)), name=f"tp-rank-{rank}",
                            daemon=True)
            p.start()
            self.procs.append(p)
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        alive = {p.sentinel: p for p in self.procs}
        while alive:
            for sentinel in wait(list(alive)):
                p = alive.pop(sentinel)
                p.join()
                if self._stopping:
                    continue
                rank = self.ranks[self.procs.index(p)]
                self.kill()
                self._on_death(f"tensor-parallel rank {rank} (pid {p.pid}) exited with "
                               f"{_exit_text(p.exitcode)}: stopping the server")
                return

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def stop(self, timeout_s: float = 30.0) -> None:
        """After the workers were told to exit: wait for them, kill those that do not."""
        self._stopping = True
        for p in self.procs:
            p.join(timeout_s)
        self.kill()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _die(message: str) -> None:
    """Log and end this process at once with exit code 1 (threads blocked in a collective
    included: nothing else ends them)."""
    log.error("%s", message)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


def watch_parent() -> None:
    """In a worker: exit when rank 0 (the parent) is gone, even from inside a collective."""
    parent = os.getppid()

    def watch():
        import time

        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                _die("tensor-parallel rank 0 is gone: exiting")

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def free_init_method(host: str = "127.0.0.1") -> str:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"
