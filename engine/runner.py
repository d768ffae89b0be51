"""The batched engine loop: prefill, then speculative (or plain) decoding for all running requests.

One `step()`:
  1. prefill the requests added since the last step (one padded batch): the target writes their
     prompt K/V and samples the first token; the draft head runs over the same positions
     (draft extend) with the target's features;
  2. for the requests already running, one speculative iteration:
       draft    num_steps x topk candidates (draft pool, scratch slots)
       tree     keep num_draft_tokens nodes (tree.py)
       verify   one target forward over the tree with its ancestor mask (tree slots)
       accept   greedy or rejection sampling (verify.py)
       commit   the accepted nodes' slots join the request; every other slot is freed
       extend   the draft runs over the accepted tokens with the target's true features, which
                rewrites the draft K/V of those positions and yields the next root's hidden.
     Without a draft head, one plain decode step.

A request's committed tokens own the same slot in the target and the draft pool. State kept per
request between steps: its committed length, the last emitted token (the next tree root, not yet
in the KV) and the draft's hidden state after that token (`draft_hidden`, one row per request).
HTTP, tokenization, stop strings and queueing live elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specdeploy.engine.attention import AttnBatch, causal_batch
from specdeploy.engine.draft import DraftHead
from specdeploy.engine.kv import PAD_SLOT, KVPool, SlotTable
from specdeploy.engine.model import LlamaModel
from specdeploy.engine.tree import DraftTree, build_tree, expand_step
from specdeploy.engine.verify import sample_from, verify_greedy, verify_sampling, warp_probs

_FEATURE_KIND = {"EAGLE": "eagle", "EAGLE3": "eagle3", "MTP": "mtp"}


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0          # 0 = off
    seed: int | None = None
    stop_token_ids: set[int] = field(default_factory=set)


@dataclass
class StepOutput:
    req_id: str
    token_ids: list[int]            # tokens emitted by this step (a stop token is included)
    num_accepted_drafts: int
    finished: bool
    finish_reason: str | None       # "stop" | "length" | None


class NoCapacity(RuntimeError):
    """The request fits the engine but not right now: retry after requests finish."""


@dataclass
class SpecConfig:
    """The speculative settings the runner needs (plan.SpecSettings has the same fields)."""
    algorithm: str = "NONE"
    num_steps: int = 0
    topk: int = 1
    num_draft_tokens: int = 1


@dataclass
class _Seq:
    req: Request
    row: int
    length: int                     # committed tokens (in both KV pools)
    root: int = -1                  # last emitted token: not yet in the KV
    num_generated: int = 0
    reserved: int = 0
    generator: torch.Generator | None = None


class Runner:
    def __init__(self, target: LlamaModel, draft: DraftHead | None = None, spec=None, *,
                 plan=None, max_total_tokens: int | None = None,
                 max_running_requests: int | None = None, context_length: int | None = None,
                 device: torch.device | str = "cpu", seed: int = 0):
        if plan is not None:
            max_total_tokens = plan.max_total_tokens
            max_running_requests = plan.max_running_requests
            context_length = plan.context_length
            if spec is None:
                spec = SpecConfig(plan.algorithm, plan.num_steps, plan.topk, plan.num_draft_tokens)
        if max_total_tokens is None or max_running_requests is None:
            raise ValueError("give a plan or both max_total_tokens and max_running_requests")
        spec = spec or SpecConfig()
        algorithm = getattr(spec, "algorithm", "NONE")
        if (draft is None) != (algorithm == "NONE"):
            raise ValueError(f"algorithm {algorithm!r} and draft head {type(draft).__name__} disagree")
        if draft is not None and draft.algorithm != algorithm:
            raise ValueError(f"draft head is {draft.algorithm}, settings say {algorithm}")
        self.target, self.draft, self.spec = target, draft, spec
        self.device = torch.device(device)
        self.context_length = context_length or target.cfg.max_position_embeddings
        self.num_steps = spec.num_steps if draft is not None else 0
        self.topk = spec.topk if draft is not None else 1
        self.num_draft_tokens = spec.num_draft_tokens if draft is not None else 1
        if draft is not None:
            if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
                raise ValueError("topk 1 needs num_draft_tokens = num_steps + 1")
            most = self.topk + (self.num_steps - 1) * self.topk ** 2 + 1
            if not 2 <= self.num_draft_tokens <= most:
                raise ValueError(f"num_draft_tokens must be in [2, {most}]")
            target.set_feature(_FEATURE_KIND[algorithm], getattr(target, "aux_layers", None) or None)
            if target.feature_size != draft.input_size:
                raise ValueError(f"target feature width {target.feature_size} != draft input "
                                 f"width {draft.input_size}")
        # The pad slot is extra: max_total_tokens usable slots.
        num_slots = max_total_tokens + 1
        tc = target.cfg
        dtype = target.embed_tokens.weight.dtype
        self.target_kv = KVPool(tc.num_layers, num_slots, tc.num_kv_heads, tc.head_dim, dtype, self.device)
        self.table = SlotTable(num_slots, max_running_requests, self.context_length, self.device)
        self.draft_kv = None
        if draft is not None:
            dc = draft.cfg
            self.draft_kv = KVPool(draft.num_kv_layers(), num_slots, dc.num_kv_heads, dc.head_dim,
                                   dtype, self.device)
            # [max_running_requests, carried width]: the draft state after each request's root.
            self.draft_hidden = torch.zeros(max_running_requests, draft.carried_size, dtype=dtype,
                                            device=self.device)
        self.max_running_requests = max_running_requests
        self._pending: list[_Seq] = []
        self._running: dict[str, _Seq] = {}
        self._reserved = 0
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self.num_draft_tokens_proposed = 0
        self.num_draft_tokens_accepted = 0

    # ---- admission -------------------------------------------------------------------------

    def _reservation(self, req: Request) -> int:
        """Slots a request can hold at its peak: prompt + output, plus one iteration's scratch."""
        scratch = (max(self.num_steps - 1, 0) * self.topk + self.num_draft_tokens) if self.draft else 1
        return len(req.prompt_ids) + req.max_tokens + scratch

    def add(self, req: Request) -> None:
        if not req.prompt_ids:
            raise ValueError(f"request {req.id}: empty prompt")
        if req.max_tokens < 1:
            raise ValueError(f"request {req.id}: max_tokens must be >= 1, got {req.max_tokens}")
        if req.id in self._running or any(s.req.id == req.id for s in self._pending):
            raise ValueError(f"request {req.id}: id already in use")
        vocab = self.target.cfg.vocab_size
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            raise ValueError(f"request {req.id}: prompt token id outside [0, {vocab})")
        if req.temperature < 0 or not 0 < req.top_p <= 1 or req.top_k < 0:
            raise ValueError(f"request {req.id}: bad sampling parameters (temperature >= 0, "
                             f"0 < top_p <= 1, top_k >= 0)")
        need_ctx = len(req.prompt_ids) + req.max_tokens + self.num_steps + 1
        if need_ctx > self.context_length:
            raise ValueError(f"request {req.id}: prompt ({len(req.prompt_ids)}) + max_tokens "
                             f"({req.max_tokens}) exceeds the context length {self.context_length}")
        need = self._reservation(req)
        if need > self.table.capacity:
            raise ValueError(f"request {req.id}: needs {need} KV slots, the pool has "
                             f"{self.table.capacity} (max_total_tokens)")
        if self._reserved + need > self.table.capacity or \
                len(self._running) + len(self._pending) >= self.max_running_requests:
            raise NoCapacity(f"request {req.id}: no room now ({self.num_running} running)")
        gen = None
        if req.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(req.seed)
        self._reserved += need
        self._pending.append(_Seq(req, row=-1, length=0, reserved=need, generator=gen))

    def abort(self, req_id: str) -> None:
        for i, seq in enumerate(self._pending):
            if seq.req.id == req_id:
                self._pending.pop(i)
                self._reserved -= seq.reserved
                return
        seq = self._running.get(req_id)
        if seq is None:
            raise KeyError(f"no request {req_id!r}")
        self._release(seq)

    def _release(self, seq: _Seq) -> None:
        self.table.free_row(seq.row, seq.length)
        self._reserved -= seq.reserved
        del self._running[seq.req.id]

    @property
    def num_free_slots(self) -> int:
        return self.table.num_free

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._pending)

    # ---- one iteration -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        decoding = list(self._running.values())
        outputs: dict[str, StepOutput] = {}
        if self._pending:
            new, self._pending = self._pending, []
            for out in self._prefill(new):
                outputs[out.req_id] = out
        if decoding:
            outs = self._spec_decode(decoding) if self.draft is not None else self._plain_decode(decoding)
            for out in outs:
                outputs[out.req_id] = out
        return list(outputs.values())

    # ---- prefill -----------------------------------------------------------------------------

    def _prefill(self, seqs: list[_Seq]) -> list[StepOutput]:
        dev = self.device
        b = len(seqs)
        lens = torch.tensor([len(s.req.prompt_ids) for s in seqs], device=dev)
        q = int(lens.max())
        tokens = torch.zeros(b, q, dtype=torch.int64, device=dev)
        slots = torch.full((b, q), PAD_SLOT, dtype=torch.int64, device=dev)
        for i, s in enumerate(seqs):
            n = len(s.req.prompt_ids)
            s.row = self.table.alloc_row()
            s.length = n
            tokens[i, :n] = torch.tensor(s.req.prompt_ids, device=dev)
            slots[i, :n] = self.table.alloc(n)
            self.table.req_to_slot[s.row, :n] = slots[i, :n]
            self._running[s.req.id] = s
        positions = torch.arange(q, device=dev).expand(b, q)
        empty = torch.zeros(b, 0, dtype=torch.int64, device=dev)
        batch = causal_batch(slots, lens, empty, torch.zeros(b, dtype=torch.int64, device=dev))
        out = self.target(tokens, positions, batch, self.target_kv)
        last = (lens - 1)
        rows = torch.arange(b, device=dev)
        logits = self.target.logits(out.hidden[rows, last])                 # [B, V]
        first = self._sample(seqs, logits)                                  # [B]
        if self.draft is not None:
            # Draft extend over the prompt: entry j = (token j + 1, target feature j).
            shifted = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
            shifted[rows, last] = first
            d_out = self.draft(shifted, out.feature, positions, batch, self.draft_kv)
            self.draft_hidden[[s.row for s in seqs]] = d_out[rows, last]
        return self._emit(seqs, [[t] for t in first.tolist()], [0] * b)

    # ---- speculative decoding ------------------------------------------------------------------

    def _spec_decode(self, seqs: list[_Seq]) -> list[StepOutput]:
        dev, draft = self.device, self.draft
        steps, k, n = self.num_steps, self.topk, self.num_draft_tokens
        b = len(seqs)
        rows = torch.tensor([s.row for s in seqs], device=dev)
        lens = torch.tensor([s.length for s in seqs], device=dev)
        roots = torch.tensor([s.root for s in seqs], device=dev)
        prefix = self.table.req_to_slot[rows, :int(lens.max())]
        sampling = any(s.req.temperature > 0 for s in seqs)
        chain_sampling = sampling and k == 1
        uniforms = self._uniforms(seqs, n + 1 + steps)                      # [B, N + 1 + S]
        params = self._sampling_params(seqs)

        # -- draft: step 0 from the stored hidden, then steps 1..S-1 through the draft model.
        scratch = self.table.alloc(b * (steps - 1) * k).view(b, (steps - 1) * k)
        hidden = self.draft_hidden[rows][:, None, :]                        # [B, 1, Hc]
        logits = draft.logits(hidden)                                       # [B, 1, Vd]
        cand_tokens, cand_scores, cand_parents, draft_q = [], [], [], []
        tokens, scores = self._draft_choose(logits, k, chain_sampling, params, uniforms[:, n + 1],
                                            draft_q)
        cand_tokens.append(tokens)
        cand_scores.append(scores)
        cand_parents.append(torch.full((b, k), -1, dtype=torch.int64, device=dev))
        list_index = torch.arange(k, device=dev).expand(b, k)               # inputs' list indices
        hidden = hidden.expand(b, k, hidden.shape[-1])
        anc = torch.zeros(b, k, (steps - 1) * k, dtype=torch.bool, device=dev)
        for i in range(1, steps):
            own = torch.arange((i - 1) * k, i * k, device=dev)
            anc[:, torch.arange(k, device=dev), own] = True
            batch = AttnBatch(scratch[:, (i - 1) * k:i * k], prefix, lens, scratch, anc)
            positions = (lens + i - 1)[:, None].expand(b, k)
            out = draft(tokens, hidden, positions, batch, self.draft_kv)     # [B, K, Hc]
            logits = draft.logits(out)                                      # [B, K, Vd]
            if chain_sampling:
                tokens, _ = self._draft_choose(logits, 1, True, params, uniforms[:, n + 1 + i], draft_q)
                cand_tokens.append(tokens)
                cand_scores.append(torch.ones(b, 1, device=dev))
                cand_parents.append(list_index)
                list_index = torch.full((b, 1), i, dtype=torch.int64, device=dev)
                hidden = out
                continue
            child_p, child_i = torch.softmax(logits, -1).topk(k, dim=-1)    # [B, K, K]
            c_scores, c_tokens, c_parent, keep = expand_step(scores, child_p,
                                                             draft.to_target_ids(child_i), k)
            base = k + (i - 1) * k * k                                      # list index of c[0]
            cand_tokens.append(c_tokens)
            cand_scores.append(c_scores)
            cand_parents.append(torch.gather(list_index, 1, c_parent))
            parent = torch.gather(c_parent, 1, keep)                        # [B, K] in 0..K-1
            tokens = torch.gather(c_tokens, 1, keep)
            scores = torch.gather(c_scores, 1, keep)
            hidden = torch.gather(out, 1, parent[:, :, None].expand(-1, -1, out.shape[-1]))
            anc = torch.gather(anc, 1, parent[:, :, None].expand(-1, -1, anc.shape[-1]))
            list_index = base + keep
        tree = build_tree(roots, torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1),
                          torch.cat(cand_parents, 1), n)

        # -- verify: one target forward over the tree.
        tree_slots = self.table.alloc(b * n).view(b, n)
        batch = AttnBatch(tree_slots, prefix, lens, tree_slots, tree.mask)
        out = self.target(tree.tokens, lens[:, None] + tree.depth, batch, self.target_kv)
        logits = self.target.logits(out.hidden)                             # [B, N, V]
        if not sampling:
            path, num_acc, bonus = verify_greedy(tree, logits)
        else:
            v = logits.shape[-1]
            p = warp_probs(logits.reshape(b * n, v), *(x.repeat_interleave(n) for x in params))
            q = None
            if chain_sampling:  # node d was drawn from the step d - 1 proposal
                q = torch.cat([torch.zeros(b, 1, v, device=dev), torch.stack(draft_q, 1)], 1)
            path, num_acc, bonus = verify_sampling(tree, p.view(b, n, v), q, uniforms[:, :n],
                                                   uniforms[:, n])

        # -- commit accepted slots, free the rest.
        valid = path >= 0                                                   # [B, S + 1]
        path_slots = torch.where(valid, torch.gather(tree_slots, 1, path.clamp(min=0)), PAD_SLOT)
        cols = lens[:, None] + torch.arange(path.shape[1], device=dev)
        self.table.req_to_slot[rows[:, None].expand_as(cols)[valid], cols[valid]] = path_slots[valid]
        in_path = torch.zeros(b, n, dtype=torch.bool, device=dev)
        in_path.scatter_(1, path.clamp(min=0), True)                        # padding -> root, kept anyway
        self.table.free(tree_slots[~in_path])
        self.table.free(scratch)

        # -- draft extend over the accepted tokens [root, d1..dk] with the target's features.
        path_tokens = torch.gather(tree.tokens, 1, path.clamp(min=0))       # [B, S + 1]
        ext_tokens = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], 1)
        rows_b = torch.arange(b, device=dev)
        ext_tokens[rows_b, num_acc] = bonus
        feature = torch.gather(out.feature, 1,
                               path.clamp(min=0)[:, :, None].expand(-1, -1, out.feature.shape[-1]))
        batch = causal_batch(path_slots, num_acc + 1, prefix, lens)
        positions = lens[:, None] + torch.arange(path.shape[1], device=dev)
        d_out = draft(ext_tokens, feature, positions, batch, self.draft_kv)
        self.draft_hidden[rows] = d_out[rows_b, num_acc]

        self.num_draft_tokens_proposed += b * (path.shape[1] - 1)
        accepted = num_acc.tolist()
        self.num_draft_tokens_accepted += sum(accepted)
        emitted = [row[1:a + 1] + [bt] for row, a, bt in
                   zip(path_tokens.tolist(), accepted, bonus.tolist())]
        for s, a in zip(seqs, accepted):
            s.length += a + 1
        return self._emit(seqs, emitted, accepted)

    def _draft_choose(self, logits, k, chain_sampling, params, uniform, draft_q):
        """logits [B, 1 or K, Vd] of the draft -> tokens [B, K] (target ids), scores [B, K].
        Chain sampling draws one token per row from the warped draft distribution and records
        that distribution (over the target vocabulary) for verification."""
        if chain_sampling:
            q = warp_probs(logits[:, -1], *params)                          # [B, Vd]
            token = sample_from(q, uniform)
            draft_q.append(self._to_target_vocab(q))
            return self.draft.to_target_ids(token)[:, None], torch.ones_like(uniform)[:, None]
        probs, ids = torch.softmax(logits[:, -1], -1).topk(k, dim=-1)
        return self.draft.to_target_ids(ids), probs

    def _to_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        v = self.target.cfg.vocab_size
        if q.shape[-1] == v and self.draft.algorithm != "EAGLE3":
            return q
        ids = self.draft.to_target_ids(torch.arange(q.shape[-1], device=q.device))
        return torch.zeros(q.shape[0], v, dtype=q.dtype, device=q.device).index_add_(1, ids, q)

    # ---- plain decoding --------------------------------------------------------------------------

    def _plain_decode(self, seqs: list[_Seq]) -> list[StepOutput]:
        dev = self.device
        b = len(seqs)
        rows = torch.tensor([s.row for s in seqs], device=dev)
        lens = torch.tensor([s.length for s in seqs], device=dev)
        slots = self.table.alloc(b).view(b, 1)
        prefix = self.table.req_to_slot[rows, :int(lens.max())]
        self.table.req_to_slot[rows, lens] = slots[:, 0]
        batch = AttnBatch(slots, prefix, lens, slots, torch.ones(b, 1, 1, dtype=torch.bool, device=dev))
        roots = torch.tensor([[s.root] for s in seqs], device=dev)
        out = self.target(roots, lens[:, None], batch, self.target_kv)
        tokens = self._sample(seqs, self.target.logits(out.hidden[:, 0]))
        for s in seqs:
            s.length += 1
        return self._emit(seqs, [[t] for t in tokens.tolist()], [0] * b)

    # ---- sampling and bookkeeping ---------------------------------------------------------------

    def _sampling_params(self, seqs):
        dev = self.device
        return (torch.tensor([s.req.temperature for s in seqs], device=dev),
                torch.tensor([s.req.top_k for s in seqs], device=dev),
                torch.tensor([s.req.top_p for s in seqs], device=dev))

    def _uniforms(self, seqs, n: int) -> torch.Tensor:
        """[B, n] uniform draws, from each request's own generator when it has a seed."""
        return torch.stack([torch.rand(n, generator=s.generator or self._generator, device=self.device)
                            for s in seqs])

    def _sample(self, seqs, logits: torch.Tensor) -> torch.Tensor:
        if all(s.req.temperature == 0 for s in seqs):
            return logits.argmax(-1)
        probs = warp_probs(logits, *self._sampling_params(seqs))
        return sample_from(probs, self._uniforms(seqs, 1)[:, 0])

    def _emit(self, seqs, emitted: list[list[int]], accepted: list[int]) -> list[StepOutput]:
        outputs = []
        for s, tokens, acc in zip(seqs, emitted, accepted):
            kept, reason = [], None
            for t in tokens:
                kept.append(t)
                s.num_generated += 1
                if t in s.req.stop_token_ids:
                    reason = "stop"
                elif s.num_generated >= s.req.max_tokens:
                    reason = "length"
                if reason:
                    break
            s.root = kept[-1]
            if reason:
                self._release(s)
            outputs.append(StepOutput(s.req.id, kept, acc, reason is not None, reason))
        return outputs
