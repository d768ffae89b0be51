"""The batched engine loop: prefill, then speculative (or plain) decoding for all running requests.

One `step()`:
  1. prefill waiting requests, one chunk of at most prefill_chunk_tokens padded tokens (long
     prompts take several steps): the target writes their prompt K/V and, where a prompt ends,
     samples the first token; the draft head runs over the same positions (draft extend) with
     the target's features;
  2. for the requests already running, one speculative iteration:
       draft    num_steps x topk candidates (draft pool, scratch slots)
       tree     keep num_draft_tokens nodes (tree.py)
       verify   one target forward over the tree with its ancestor mask (tree slots)
       accept   greedy or rejection sampling (verify.py)
       extend   the draft runs over the accepted tokens with the target's true features, which
                rewrites the draft K/V of those positions and yields the next root's hidden
       commit   the accepted nodes' slots join the request; every other slot is freed.
     Without a draft head, one plain decode step.

Adaptive speculation (`adaptive=True`): the runner holds one set of model calls (and CUDA
graphs, in one shared pool) per candidate shape of `speculative/adaptive.py` and asks its policy
each step which one to run for the current batch size, from the step costs measured here at
start-up and the acceptance the steps report back. The NONE shape is a plain target decode
that also returns the target's feature: the draft is not run, the (next token, feature) entry
it would have consumed is kept in a per-request buffer of `catch_up_tokens` entries, and the
draft runs over them all at once when the buffer is full or before the request's next
speculative step ("catch-up": one draft forward per catch_up_tokens plain steps instead of one
each). After a catch-up the draft's KV and carried hidden state are exactly what a draft extend
after every token would have left, so a request may change shape on any step.

A request's committed tokens own the same slot in the target and the draft pool. State kept per
request between steps: its committed length, the last emitted token (the next tree root, not yet
in the KV) and the draft's hidden state after that token (`draft_hidden`, one row per request).
HTTP, tokenization, stop strings and queueing live elsewhere.

Decode steps by row (rows.py): that per-request state lives on the device, indexed by request
row, and each decode step reads and updates it inside its graph; what the host sends is which
rows run and the slots the step took, packed into one pinned buffer and one copy, and what
comes back is one packed copy (tokens; accepted counts, bonus and path tokens, slots to free)
with an event. The host keeps its mirror (lengths, roots, emitted tokens) from that copy.

Overlap (`overlap=True`, the default on CUDA): since a step's input does not depend on the
step before, `_decode` launches step N, then stages step N+1 for the same requests in the same
shape (takes its slots from the free ones, writes its pinned rows, queues their copy behind
step N), and only then waits for step N. The commit that follows gives the staged step back
if the batch changed (a request finished, was aborted, or one joined) or slots run short; the
next step then stages itself as without overlap. The tokens are the same either way; the
staged slots count as free for admission (they are the running requests' reserved scratch).

Launch-ahead (`launch_ahead=True`, `--launch-ahead`): step N+1 is launched, for every request
running then, before step N is waited for (it reads the row state step N leaves on the
device), so the device never waits for the host between steps, not even for the commit and
the caller's work between calls. A request that step N finishes (or that is aborted) rides
step N+1 too: its output is discarded and its slots go back when N+1 is collected, so each
request needs one more step of context (`max_sequence_tokens`). Each call still returns one
step's outputs; every request gets the same tokens. Not with adaptive speculation, whose
policy sees each step before choosing the next.

Roles (prefill/decode disaggregation, docs/disaggregation.md): "both" does all of the above.
"prefill" stops after step 1: a request (max_tokens 1) that has its first token is *held*, its
slots and row kept, until `export_held` has put its state into the metadata buffer and the
transfer is done (`release_held`). "decode" also `receive`s requests whose prompt KV another
server writes into the slots `receive` took; `activate` then starts them from the metadata
buffer's row exactly where a local prefill would have left them.

With the prefix cache on (prefix_cache.py), a prompt's prefill starts after its longest cached
prefix, whose slots the request shares with the tree; finished requests leave their positions
there.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.runtime.calls import ModelCalls
from specdeploy.engine.models.draft import DraftHead
from specdeploy.engine.memory.kv import PAD_SLOT, KVPool, PoolExhausted, SlotTable
from specdeploy.engine.runtime.prefix_cache import DEFER_MIN_TOKENS, PrefixCache, shared_prefix_len
from specdeploy.engine.runtime.rows import RowState, RowSteps
from specdeploy.engine.runtime.sampling import LogitControls, StepLogits, TokenLogprob, wants_processing
from specdeploy.engine.models.layers import argmax
from specdeploy.engine.models.llama import LlamaModel
from specdeploy.engine.planner.plan import PREFILL_CHUNK_TOKENS, SERVER_ROLES, max_draft_tokens
from specdeploy.engine.speculative.adaptive import NONE, AdaptivePolicy, SpecShape, candidate_shapes
from specdeploy.engine.speculative.logits import top_logprobs
from specdeploy.engine.speculative.verify import sample_from, warp_probs

_FEATURE_KIND = {"EAGLE": "eagle", "EAGLE3": "eagle3", "MTP": "mtp"}
# A request's top_k goes into an int64 tensor with the batch's: a larger one is refused at admission.
_INT64_MAX = 2**63 - 1
# Prompt positions whose logits are taken at once for prompt logprobs (x vocabulary x 4 bytes).
_PROMPT_LOGPROBS_ROWS = 256


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
    # Penalties, bias, grammar, logprobs (sampling.py): such a request's steps run eagerly.
    controls: LogitControls | None = None


@dataclass
class StepOutput:
    req_id: str
    token_ids: list[int]            # tokens emitted by this step (a stop token is included)
    num_accepted_drafts: int
    finished: bool
    finish_reason: str | None       # "stop" | "length" | None
    num_cached_tokens: int = 0      # on a request's first output: prompt tokens the prefix cache held
    num_draft_tokens: int = 0       # draft tokens this step proposed for it (0: prefill or a plain step)
    logprobs: list[TokenLogprob] | None = None         # one per token_ids entry, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first output: prompt tokens 1.. (echo)



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
    tokens: list[int] = field(default_factory=list)  # emitted so far, including any cut by a stop
    # Prefix cache: row positions [0, cached) are the tree's slots, locked at cache_node;
    # matched_slots fill the row when it is taken; num_cached_tokens is what the hit saved.
    cached: int = 0
    cache_node: object = None
    matched_slots: torch.Tensor | None = None
    num_cached_tokens: int = 0
    prompt_keys: list[int] | None = None
    match_version: int = -1         # the cache's num_inserted at its last match
    pending: int = 0                # committed tokens the draft has not run over yet (adaptive NONE steps)
    prompt_lps: list | None = None  # prompt log-probabilities gathered over its prefill chunks


@dataclass
class _Launched:
    """A decode step on its way: its requests in batch order, the slots it holds past the
    scratch [B, N] (the out slot of a plain step), its output's host copy and the event it is
    done at (None: already there)."""
    seqs: list
    shape: SpecShape
    steps: RowSteps
    slots: torch.Tensor
    host: torch.Tensor
    event: object
    logprobs: list | None = None    # per request, its emitted tokens' (eager steps with controls)


@dataclass
class _Staged:
    """A decode step's input, staged: host rows copied to `packed` (on the device), the slots
    it took [B * (K - 1)], row after row; `key` says which step it was staged for."""
    key: tuple
    packed: torch.Tensor
    slots: torch.Tensor


class Runner:
    def __init__(self, target: LlamaModel, draft: DraftHead | None = None, spec=None, *,
                 plan=None, max_total_tokens: int | None = None,
                 max_running_requests: int | None = None, context_length: int | None = None,
                 device: torch.device | str = "cpu", seed: int = 0,
                 cuda_graph_batch_sizes: tuple[int, ...] | None = None, graph_mode: str | None = None,
                 prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS, fused_spec_step: bool = True,
                 role: str = "both", prefix_cache: bool = False, adaptive: bool = False,
                 adaptive_shapes: list[SpecShape] | None = None, step_costs_s: dict | None = None,
                 catch_up_tokens: int = 16, policy_options=None,
                 kv_cache_dtype: torch.dtype | None = None, overlap: bool | None = None,
                 launch_ahead: bool = False):
        """graph_mode: "capture" (CUDA graphs; the default on CUDA when batch sizes are known),
        "padded" (the graphs' static buffers and padding, replayed eagerly: any device),
        "off" (plain eager calls; the default on CPU).
        prefill_chunk_tokens: padded tokens one prefill forward carries (the plan sizes the
        activation workspace for this many); longer prompts are prefilled over several steps.
        fused_spec_step: with graphs, one graph per speculative iteration (the default); False
        graphs each model call alone, with tree building and acceptance eager in between.
        adaptive: choose the shape per step among adaptive_shapes (default: candidate_shapes of
        the configured one); step_costs_s {(shape, bucket): seconds} replaces the start-up
        measurement; catch_up_tokens: plain steps the draft may lag behind; policy_options:
        keyword arguments of AdaptivePolicy.
        role: "both", "prefill" or "decode" (module docstring); the two split roles need a plan,
        whose metadata buffer shape they allocate.
        prefix_cache: keep finished requests' KV in the slot pool and reuse it for prompts that
        share a prefix (prefix_cache.py); evicted least recently used when slots are needed.
        overlap: stage the next decode step (its slots and packed input) while the current one
        runs on the device (module docstring); default on for CUDA. The tokens are the same
        either way.
        launch_ahead: launch the next decode step before waiting for the current one (module
        docstring): a request rides one discarded step past its end, so each needs one more
        step of context (max_sequence_tokens); not with adaptive speculation."""
        if role not in SERVER_ROLES:
            raise ValueError(f"role {role!r}: use one of {', '.join(SERVER_ROLES)}")
        if role != "both" and plan is None:
            raise ValueError(f"role {role!r} needs a plan (its disaggregation metadata buffer)")
        self.role = role
        if launch_ahead and adaptive:
            raise ValueError("launch_ahead: not with adaptive speculation (its policy sees each step "
                             "before choosing the next)")
        self.launch_ahead = launch_ahead
        if plan is not None:
            max_total_tokens = plan.max_total_tokens
            max_running_requests = plan.max_running_requests
            context_length = plan.context_length
            cuda_graph_batch_sizes = cuda_graph_batch_sizes or tuple(plan.cuda_graph_batch_sizes)
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
            most = max_draft_tokens(self.num_steps, self.topk)
            if not 2 <= self.num_draft_tokens <= most:
                raise ValueError(f"num_draft_tokens must be in [2, {most}]")
        configured = SpecShape(self.num_steps, self.topk, self.num_draft_tokens) if draft else NONE
        self.shapes = [configured]
        if adaptive:
            if draft is None:
                raise ValueError("adaptive speculation needs a draft head")
            self.shapes = sorted(set(adaptive_shapes or candidate_shapes(
                self.num_steps, self.topk, self.num_draft_tokens)))
            if NONE not in self.shapes:
                self.shapes.insert(0, NONE)
            for sh in self.shapes:
                if not sh.is_none and (sh.num_steps < 1 or sh.topk < 1 or not (
                        sh.num_draft_tokens == sh.num_steps + 1 if sh.topk == 1 else
                        2 <= sh.num_draft_tokens <= max_draft_tokens(sh.num_steps, sh.topk))):
                    raise ValueError(f"adaptive shape {sh.label}: not a valid (steps, topk, draft tokens)")
            if catch_up_tokens < 1:
                raise ValueError(f"catch_up_tokens must be >= 1, got {catch_up_tokens}")
        # The most any shape looks ahead and takes as scratch (admission reserves for it).
        self._max_steps = max(sh.num_steps for sh in self.shapes)
        self._max_scratch = max(max(sh.num_steps - 1, 0) * sh.topk + sh.num_draft_tokens
                                for sh in self.shapes)
        if draft is not None:
            target.set_feature(_FEATURE_KIND[algorithm], getattr(target, "aux_layers", None) or None)
            # What this runner's draft consumes; re-applied each step in case another user of
            # the same target (a second runner, a training loop) switched it meanwhile.
            self._feature = (target.feature_kind, target.aux_layers)
            if target.feature_size != draft.input_size:
                raise ValueError(f"target feature width {target.feature_size} != draft input "
                                 f"width {draft.input_size}")
        # The pad slot is extra: max_total_tokens usable slots.
        num_slots = max_total_tokens + 1
        tc = target.cfg
        dtype = target.embed_tokens.weight.dtype
        # K/V in the model dtype, or e4m3 codes (kv_cache_dtype, or the plan's "fp8_e4m3")
        if kv_cache_dtype is None and plan is not None and plan.target.kv_cache_dtype == "fp8_e4m3":
            kv_cache_dtype = torch.float8_e4m3fn
        kv_dtype = kv_cache_dtype or dtype
        # Under tensor parallelism each rank's pools hold its KV heads only (target.tp_rank/size).
        tp = (getattr(target, "tp_rank", 0), getattr(target, "tp_size", 1))
        self.max_running_requests = max_running_requests
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.table = SlotTable(num_slots, max_running_requests, self.context_length, self.device)
        own_pools = hasattr(target, "make_kv")
        if own_pools and kv_dtype != dtype:
            raise ValueError(f"an {kv_dtype} KV cache is not supported for {type(target).__name__} targets yet")
        if own_pools:
            # DeepSeek-V4 (engine/memory/compressed_kv.py) keeps a request's recent tokens and
            # compressed entries in pools of its own, trimmed as tokens are committed: a finished
            # request's slots cannot be reused by another. (Between servers the kept rows move:
            # staged_kv; a draft that lags behind adaptive plain steps trims as it runs: `lags`.)
            if prefix_cache:
                raise ValueError(f"the prefix cache is not supported for {type(target).__name__} targets yet")
            # Its pools are sized for the slots one step may hold: a prefill chunk, or every
            # request's tree and scratch.
            in_flight = max(prefill_chunk_tokens, max_running_requests * self.slots_needed(0, 0))
            self.target_kv = target.make_kv(num_slots, max_total_tokens, max_running_requests, in_flight,
                                            dtype, self.device)
            self.table.listeners.append(self.target_kv)
        else:
            self.target_kv = KVPool(tc.num_layers, num_slots, tc.num_kv_heads, tc.head_dim, kv_dtype, self.device,
                                    *tp)
        # With a draft a slot's draft K/V also depends on the next token: bigram keys.
        self.prefix_cache = (PrefixCache(self.table, lookahead=int(draft is not None))
                             if prefix_cache else None)
        self.draft_kv = None
        if draft is not None:
            dc = draft.cfg
            if hasattr(draft, "make_kv"):
                # Adaptive plain steps leave the draft behind: its rows trim as it catches up, so
                # each request may hold catch_up_tokens more of them (rows the plan does not count).
                lagging = max_running_requests * catch_up_tokens if adaptive else 0
                self.draft_kv = draft.make_kv(num_slots, max_total_tokens, max_running_requests, in_flight + lagging,
                                              dtype, self.device)
                self.draft_kv.lags = adaptive
                self.table.listeners.append(self.draft_kv)
            else:
                self.draft_kv = KVPool(draft.num_kv_layers(), num_slots, dc.num_kv_heads, dc.head_dim,
                                       kv_dtype, self.device, *tp)
            # [max_running_requests + 1, carried width]: the draft state after each request's
            # root (the last row is the padding row's, rows.py).
            self.draft_hidden = torch.zeros(max_running_requests + 1, draft.carried_size, dtype=dtype,
                                            device=self.device)
        self.metadata = None
        if role != "both":
            from specdeploy.engine.runtime.transfer import MetadataBuffers

            # [max_running_requests, H_s] as the plan sizes it; the draft's carried state must fit
            # a row exactly (H_s where hidden_size was meant would be 4x short for hc_mult 4).
            # In host memory on any device: the transfer engine reads and writes it there
            # (a row is copied to or from the device once per request).
            self.metadata = MetadataBuffers(plan.buffers, dtype, "cpu", pin=self.device.type == "cuda")
            rows, width = plan.buffers.metadata_hidden_states_shape
            carried = draft.carried_size if draft is not None else width
            if width != carried or rows != max_running_requests:
                raise ValueError(f"the plan's metadata buffer is [{rows}, {width}]; this engine "
                                 f"needs [{max_running_requests}, {carried}] (the draft's carried width)")
        self.calls = ModelCalls(target, draft, self.target_kv, self.draft_kv, self.num_steps,
                                self.topk, self.num_draft_tokens)
        if graph_mode is None:
            graph_mode = "capture" if self.device.type == "cuda" and cuda_graph_batch_sizes else "off"
        if graph_mode not in ("capture", "padded", "off"):
            raise ValueError(f"graph_mode {graph_mode!r}: use 'capture', 'padded' or 'off'")
        if graph_mode != "off":
            if not cuda_graph_batch_sizes:
                raise ValueError(f"graph_mode {graph_mode!r} needs cuda_graph_batch_sizes (or a plan)")
            from specdeploy.engine.runtime.graphs import GraphedCalls
            self.calls = GraphedCalls(self.calls, cuda_graph_batch_sizes, self.context_length,
                                      capture=graph_mode == "capture", fused=fused_spec_step,
                                      step_graphs=False)
            if plan is not None and draft is not None:
                _check_buffers_against_plan(self.calls.buffer_shapes(), plan.buffers)
        # The calls of every shape this runner may run, the configured one's being self.calls.
        self._calls = {configured: self.calls}
        self.policy: AdaptivePolicy | None = None
        # Under tensor parallelism every rank must decode in the same shape, and each rank's
        # policy times its own steps: `agree_shape(shape) -> shape` makes them agree (rank 0's
        # choice, broadcast; engine/runtime/distributed.py). None: this runner decides alone.
        self.agree_shape = None
        self.spec_shape = configured      # the shape of the last decode step
        self.decoded_shape: SpecShape | None = None   # that of this step's, None if it decoded nothing
        if adaptive:
            self._eager_calls = ModelCalls(target, draft, self.target_kv, self.draft_kv, 0, 1, 1)
            pool = getattr(self.calls, "pool", None)
            for sh in self.shapes:
                if sh in self._calls:
                    continue
                calls = ModelCalls(target, draft, self.target_kv, self.draft_kv, *_fields(sh))
                if graph_mode != "off":
                    calls = GraphedCalls(calls, cuda_graph_batch_sizes, self.context_length,
                                         capture=graph_mode == "capture", fused=fused_spec_step, pool=pool,
                                         step_graphs=False)
                    pool = calls.pool
                self._calls[sh] = calls
            self.catch_up_tokens = catch_up_tokens
            hin = target.feature_size
            # [max_running_requests + 1, catch_up_tokens(, Hin)]: per row the (next token, target
            # feature) entries of its plain steps since the draft last ran, and how many.
            self._catch_up_ids = torch.zeros(max_running_requests + 1, catch_up_tokens, dtype=torch.int64,
                                             device=self.device)
            self._catch_up_feature = torch.zeros(max_running_requests + 1, catch_up_tokens, hin, dtype=dtype,
                                                 device=self.device)
            self._catch_up_count = torch.zeros(max_running_requests + 1, dtype=torch.int64, device=self.device)
        # The decode steps by request row (rows.py), one per shape, their graphs in one pool.
        self.rows = RowState(self.table, self.draft_hidden if draft is not None else None,
                             (self._catch_up_ids, self._catch_up_feature, self._catch_up_count)
                             if adaptive else None)
        self._row_steps: dict[SpecShape, RowSteps] = {}
        pool = None
        for sh, calls in self._calls.items():
            kind = "plain" if draft is None else "feature" if sh.is_none else "spec"
            pool = getattr(calls, "pool", None) or pool
            self._row_steps[sh] = steps = RowSteps(
                calls, self.rows, kind, sh, graph_mode, cuda_graph_batch_sizes or (), self.context_length,
                fused_spec_step, pool)
            pool = steps.pool
        # Overlap: the next step's staged input (and the slots it took), see _decode. Not with
        # pools that follow every slot handed out (DeepSeek-V4's): they are sized for one step.
        self.overlap = (self.device.type == "cuda") if overlap is None else overlap
        self.overlap = self.overlap and not self.table.listeners and not launch_ahead
        if launch_ahead and self.table.listeners:
            raise ValueError(f"launch_ahead: not for {type(target).__name__} targets (pools sized for one step)")
        self._ahead: _Staged | None = None
        self._current: _Launched | None = None      # launched, not collected yet (this call)
        self._in_flight: _Launched | None = None    # launched ahead, collected next call
        self._stashed: list[StepOutput] = []        # a collected step's outputs, for the next call
        self.num_decode_steps = 0
        self.num_overlapped_steps = 0     # decode steps whose input was staged during the previous
        self._pending: list[_Seq] = []
        self._running: dict[str, _Seq] = {}
        self._held: dict[str, _Seq] = {}        # prefill role: first token out, state not sent yet
        self._receiving: dict[str, _Seq] = {}   # decode role: slots taken, KV arriving
        self._reserved = 0
        # What the step in progress took and has not committed yet, given back if it fails:
        # slot tensors, (row, start, end) req_to_slot entries written, requests given a row.
        self._step_slots: list[torch.Tensor] = []
        self._step_entries: list[tuple[int, int, int]] = []
        self._step_rows: list[_Seq] = []
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        # Host staging of the decode steps' packed input and output (pinned on CUDA, so that
        # neither copy waits): two input buffers, one being filled while the other's copy may
        # still be queued behind the running step, each with the event of its last copy.
        pin = self.device.type == "cuda"
        rows_max = max([max_running_requests, *(cuda_graph_batch_sizes or ())])
        width = max(st.width for st in self._row_steps.values())
        out_width = max(st.out_width for st in self._row_steps.values())
        self._ring = [torch.zeros(rows_max * width, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._ring_events = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._ring_next = 0
        self._out_host = [torch.zeros(max_running_requests * out_width, dtype=torch.int64, pin_memory=pin)
                          for _ in range(2)]
        self._out_events = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._out_next = 0
        # Greedy requests' sampling parameters and (unused) uniform draws, as device constants.
        m = max_running_requests
        self._greedy = (torch.zeros(m, device=self.device),
                        torch.zeros(m, dtype=torch.int64, device=self.device),
                        torch.ones(m, device=self.device))
        self._greedy_views: dict[tuple[int, int], tuple] = {}
        self._greedy_uniforms = torch.full(
            (m, max(sh.num_draft_tokens + 1 + sh.num_steps for sh in self.shapes)), 0.5, device=self.device)
        self.num_draft_tokens_proposed = 0
        self.num_draft_tokens_accepted = 0
        if adaptive:
            buckets = sorted(cuda_graph_batch_sizes) if graph_mode != "off" \
                else _default_buckets(max_running_requests)
            costs = step_costs_s if step_costs_s is not None else self.measure_step_costs(buckets)
            self.policy = AdaptivePolicy(self.shapes, costs, **(policy_options or {}))

    # ---- admission -------------------------------------------------------------------------

    def slots_needed(self, prompt_len: int, max_tokens: int) -> int:
        """Slots a request can hold at its peak: prompt + output, plus one iteration's scratch
        (the draft's (num_steps - 1) x topk and the verify tree's num_draft_tokens; 1 without a draft)."""
        scratch = self._max_scratch if self.draft else 1
        return prompt_len + max_tokens + scratch

    @property
    def max_sequence_tokens(self) -> int:
        """The most prompt + max_tokens one request may have: the context minus the positions
        one draft tree looks ahead past the committed tokens."""
        return self.context_length - (self._max_steps + 1) * (2 if self.launch_ahead else 1)

    def max_new_tokens(self, prompt_len: int) -> int:
        """The largest max_tokens a request with this prompt can be admitted with (by context
        and by pool size); 0 or less when the prompt alone does not fit."""
        return min(self.max_sequence_tokens - prompt_len,
                   self.table.capacity - self.slots_needed(prompt_len, 0))

    def add(self, req: Request) -> None:
        self._pending.append(self._admit(req))

    def _admit(self, req: Request, match: bool = True) -> _Seq:
        """Check a request and reserve its worst case; -> its (unscheduled) sequence, started
        at its cached prefix if `match`."""
        if not req.prompt_ids:
            raise ValueError(f"request {req.id}: empty prompt")
        if req.max_tokens < 1:
            raise ValueError(f"request {req.id}: max_tokens must be >= 1, got {req.max_tokens}")
        if self.role == "prefill" and req.max_tokens != 1:
            raise ValueError(f"request {req.id}: a prefill server computes the first token only "
                             f"(max_tokens 1, got {req.max_tokens})")
        if (req.id in self._running or req.id in self._held or req.id in self._receiving
                or any(s.req.id == req.id for s in self._pending)):
            raise ValueError(f"request {req.id}: id already in use")
        vocab = self.target.cfg.vocab_size
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            raise ValueError(f"request {req.id}: prompt token id outside [0, {vocab})")
        if not (0 <= req.temperature < math.inf and 0 < req.top_p <= 1 and 0 <= req.top_k <= _INT64_MAX):
            raise ValueError(f"request {req.id}: bad sampling parameters (temperature >= 0, "
                             f"0 < top_p <= 1, 0 <= top_k < 2**63)")
        if req.seed is not None and not -2**63 <= req.seed < 2**64:
            raise ValueError(f"request {req.id}: seed {req.seed} is outside [-2**63, 2**64)")
        if len(req.prompt_ids) + req.max_tokens > self.max_sequence_tokens:
            raise ValueError(f"request {req.id}: prompt ({len(req.prompt_ids)}) + max_tokens "
                             f"({req.max_tokens}) exceeds the context length {self.context_length}")
        need = self.slots_needed(len(req.prompt_ids), req.max_tokens)
        if need > self.table.capacity:
            raise ValueError(f"request {req.id}: needs {need} KV slots, the pool has "
                             f"{self.table.capacity} (max_total_tokens)")
        if self.num_running >= self.max_running_requests:
            raise NoCapacity(f"request {req.id}: no room now ({self.num_running} running)")
        seq = _Seq(req, row=-1, length=0, reserved=need)
        if req.controls is not None and req.controls.prompt_logprobs is not None:
            seq.prompt_lps = []
        if req.seed is not None:  # before anything is taken: nothing to give back if it fails
            seq.generator = torch.Generator(device=self.device).manual_seed(req.seed)
        # From here seq owns what it takes (a cache lock): any failure gives it back.
        try:
            if match:
                self._match_prefix(seq)
            # Every admitted request may still take (reserved - length) slots; free and evictable
            # slots must cover all of that (without a cache: total reserved <= capacity).
            outstanding = self._reserved - sum(s.length for s in self._all_seqs())
            if outstanding + need - seq.length > self.num_free_slots:
                raise NoCapacity(f"request {req.id}: no room now ({self.num_running} running)")
        except BaseException:
            self._release_slots(seq)
            raise
        self._reserved += need
        return seq

    # ---- disaggregation ------------------------------------------------------------------------

    def receive(self, req: Request) -> tuple[int, list[int]]:
        """Decode role: admit a request whose prompt another server prefills; -> (its row, the
        slots its prompt tokens' KV must be written to, position by position). The request
        holds them, and decodes nothing, until `activate` (or `abort`)."""
        if self.role != "decode":
            raise RuntimeError(f"receive() on a {self.role!r} runner")
        seq = self._admit(req, match=False)   # the prefill server sends every prompt position
        n = len(req.prompt_ids)
        try:
            seq.row = self.table.alloc_row()
            self._make_room(n)
            # Committed as they are taken: the positions arrive computed (DeepSeek-V4's pools
            # give them only the rows a committed request keeps).
            slots = self.table.alloc_arrived(seq.row, n)
        except BaseException as e:  # the reservation and the row go back: it holds nothing
            if seq.row >= 0:
                self.table.free_row(seq.row, 0)
            self._reserved -= seq.reserved
            if isinstance(e, PoolExhausted):
                # Slots or pool rows held by running requests: it waits for them, as admission does.
                raise NoCapacity(f"request {req.id}: {e}") from e
            raise
        seq.length = n
        self._receiving[req.id] = seq
        return seq.row, slots.tolist()

    def kv_pools(self) -> list:
        return [p for p in (self.target_kv, self.draft_kv) if p is not None]

    @property
    def slot_row_pools(self) -> bool:
        """Whether every pool has one row per token slot (KVPool: addressable by slot runs, the
        direct transfer path); DeepSeek-V4's pools (V4KV) move only staged."""
        return all(isinstance(p, KVPool) for p in self.kv_pools())

    def kv_signature(self) -> tuple:
        """What a peer's pools must equal for their bytes to mean the same here, per pool
        (protocol.ServerInfo): (layers, bytes per slot) of a KVPool; (name, layers, row bytes,
        ratio, keep) of each of a V4KV's pools."""
        from specdeploy.engine.runtime.transfer import PoolLayout

        def one(pool):
            if isinstance(pool, KVPool):
                return PoolLayout.of(pool).shape()
            return tuple((name, len(spec.layers), pool.data[name][0, 0].numel() * pool.data[name].element_size(),
                          spec.ratio, spec.keep) for name, spec in pool.pools.items())

        return tuple(one(p) for p in self.kv_pools())

    def staged_kv(self, n: int):
        """Where n prompt tokens' rows of every pool lie in a staging region (transfer.StagedKV)."""
        from specdeploy.engine.runtime.transfer import StagedKV

        if self.slot_row_pools:
            return StagedKV.of(self._kv_pairs(), n)
        return StagedKV.of_pieces([piece for p in self.kv_pools() for piece in p.staged_rows(n)])

    def _kv_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(p.k, p.v) for p in self.kv_pools()]

    def _kv_pieces(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor, rows) of every pool for a request whose prompt positions are `slots` (device)."""
        from specdeploy.engine.runtime.transfer import pool_pieces

        if self.slot_row_pools:
            return pool_pieces(self._kv_pairs(), slots)
        return [piece for p in self.kv_pools() for piece in p.staged_pieces(slots, slots.numel())]

    def gather_kv(self, slots: list[int], region: torch.Tensor) -> None:
        """Pack the rows of `slots` (a request's prompt positions, in order) in every pool into a
        staging region (a 1-d uint8 host tensor, pinned on CUDA; layout transfer.StagedKV): for
        slot-row pools row j + 1 of each half is slots[j]. Returns when the bytes are in host memory."""
        from specdeploy.engine.runtime.transfer import gather_pieces

        gather_pieces(self._kv_pieces(torch.tensor(slots, dtype=torch.int64, device=self.device)), region)

    def gather_held(self, req_id: str, region: torch.Tensor) -> None:
        """gather_kv of a held request's prompt slots (prefill role)."""
        self.gather_kv(self.held_slots(req_id), region)

    def _scatter_kv(self, index: torch.Tensor, region: torch.Tensor) -> None:
        """The inverse of gather_kv, into the slots `index`; returns when the region may be reused."""
        from specdeploy.engine.runtime.transfer import scatter_pieces

        scatter_pieces(self._kv_pieces(index), region)

    def activate(self, req_id: str, staged: torch.Tensor | None = None) -> list[StepOutput]:
        """Decode role: the prompt KV has arrived (in the request's slots, or in `staged`, a
        staging region laid out as gather_kv's, which goes to its slots now) and the metadata
        buffer's row holds the first token and the draft's carried state; the request runs from
        here, as after a local prefill. -> the first token's output."""
        seq = self._receiving[req_id]
        md = self.metadata
        cached, first = self.check_arrived(req_id)
        if staged is not None:
            self._scatter_kv(self.table.req_to_slot[seq.row, :seq.length], staged)
        del self._receiving[req_id]
        if self.draft is not None:
            self.draft_hidden[seq.row] = md.hidden[seq.row].to(self.device)
            if self.policy is not None:
                self._catch_up_count[seq.row] = 0
        if seq.generator is not None and seq.req.temperature > 0:
            # The prefill server drew the first token's uniform from a generator with this seed;
            # drawing it here too keeps a seeded request's stream what one server gives it.
            self._uniforms([seq], 1)
        self._running[req_id] = seq
        seq.num_cached_tokens = cached
        outputs = self._emit([seq], [[first]], [0])
        outputs[0].num_cached_tokens = cached
        if req_id in self._running:
            self.rows.start([seq.row], [seq.length], [seq.root])
        return outputs

    def check_arrived(self, req_id: str) -> tuple[int, int]:
        """A received request's metadata row, checked before anything acts on it: -> (cached
        prompt tokens, first token); ValueError for a row no prefill of this prompt could write."""
        seq = self._receiving[req_id]
        md = self.metadata
        cached = int(md.fixed["cached_tokens"][seq.row])
        if not 0 <= cached < seq.length:
            raise ValueError(f"request {req_id}: the prefill server reports {cached} cached prompt "
                             f"tokens of {seq.length}")
        first = int(md.fixed["output_token_id"][seq.row])
        if not 0 <= first < self.target.cfg.vocab_size:
            raise ValueError(f"request {req_id}: first token {first} outside the vocabulary")
        return cached, first

    def held_slots(self, req_id: str) -> list[int]:
        """A held request's prompt slots, position by position (prefill role)."""
        seq = self._held[req_id]
        return self.table.req_to_slot[seq.row, :seq.length].tolist()

    def export_held(self, req_id: str) -> tuple[int, list[int]]:
        """Prefill role: put a held request's first token, its prefix-cache hit and the draft's
        carried state into its metadata row; -> (row, the slots of its prompt tokens, position by
        position). The slots stay the request's until `release_held`."""
        seq = self._held[req_id]
        md = self.metadata
        md.fixed["output_token_id"][seq.row] = seq.root
        md.fixed["cached_tokens"][seq.row] = seq.num_cached_tokens  # its prefix-cache hit
        if self.draft is not None:
            md.hidden[seq.row] = self.draft_hidden[seq.row].cpu()
        return seq.row, self.held_slots(req_id)

    def release_held(self, req_id: str) -> None:
        seq = self._held.pop(req_id)
        self._release_slots(seq)
        self._reserved -= seq.reserved

    def is_held(self, req_id: str) -> bool:
        return req_id in self._held

    def is_receiving(self, req_id: str) -> bool:
        return req_id in self._receiving

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_receiving(self) -> int:
        return len(self._receiving)

    def abort(self, req_id: str) -> None:
        self._stashed = [o for o in self._stashed if o.req_id != req_id]
        for i, seq in enumerate(self._pending):
            if seq.req.id == req_id:
                self._pending.pop(i)
                self._reserved -= seq.reserved
                self._release_slots(seq)  # it may be partly prefilled, or hold a cache hit
                return
        if req_id in self._held:
            self.release_held(req_id)
            return
        seq = self._receiving.pop(req_id, None)
        if seq is not None:
            self._release_slots(seq, keep=False)  # its KV may not have arrived
            self._reserved -= seq.reserved
            return
        seq = self._running.get(req_id)
        if seq is None:
            raise KeyError(f"no request {req_id!r}")
        self._release(seq)

    def _release(self, seq: _Seq, hold: bool = False) -> None:
        del self._running[seq.req.id]
        self._drop_ahead()  # it was staged for a batch with this request in it
        if not self._running:
            self._drop_in_flight()
        if hold:  # prefill role: its state has yet to reach a decode server
            self._held[seq.req.id] = seq
            return
        self._release_slots(seq)
        self._reserved -= seq.reserved

    def _all_seqs(self) -> list[_Seq]:
        """Every request holding a reservation."""
        return [*self._pending, *self._running.values(), *self._held.values(), *self._receiving.values()]

    @property
    def num_free_slots(self) -> int:
        """Slots a request can get now: free ones and unlocked cached ones (evicted on demand)."""
        cache = self.prefix_cache
        # The staged next step's slots count as free: they are the running requests' scratch,
        # which their reservations already hold, and are given back whenever slots run short.
        ahead = self._ahead.slots.numel() if self._ahead is not None else 0
        return self.table.num_free + ahead + (cache.evictable_slots if cache is not None else 0)

    # ---- prefix cache (prefix_cache.py) --------------------------------------------------------

    def _match_prefix(self, seq: _Seq) -> None:
        """Start seq at its longest cached prefix (at most all but the last prompt token, whose
        logits give the first output token), locked until it is released. Called at admission
        and again before its first prefill chunk, when more may be cached."""
        cache = self.prefix_cache
        if cache is None:
            return
        if seq.cache_node is not None and seq.match_version == cache.num_inserted:
            return  # nothing was cached since its last match
        seq.match_version = cache.num_inserted
        # Prompt log-probabilities want every prompt position computed: no reuse (it still caches).
        longest = 0 if seq.prompt_lps is not None else len(seq.req.prompt_ids) - 1
        match = cache.match(self._seq_keys(seq), longest)
        if seq.cache_node is not None and match.length <= seq.length:
            return
        cache.lock(match.node)
        if seq.cache_node is not None:
            cache.unlock(seq.cache_node)
        seq.cache_node, seq.matched_slots = match.node, match.slots
        seq.length = seq.cached = match.length

    def _cache_prefix(self, seq: _Seq) -> None:
        """After a prefill chunk: cache the positions seq has written (others with the same
        prompt can match them while it runs) and point its row at the tree's slots."""
        cache, n = self.prefix_cache, seq.length
        keys = self._seq_keys(seq)[:n]
        if len(keys) < n or n <= seq.cached:
            return
        row = self.table.req_to_slot[seq.row]
        existed, match = cache.insert(keys, row[:n])
        if existed > seq.cached:  # written twice (another request cached them meanwhile): keep the tree's
            self.table.free(row[seq.cached:existed].clone())
            row[seq.cached:existed] = match.slots[seq.cached:existed]
        cache.lock(match.node)
        cache.unlock(seq.cache_node)
        seq.cache_node, seq.cached = match.node, n

    def _defer_for_cache(self, seq: _Seq, chosen: list[tuple[_Seq, int]]) -> bool:
        """Whether seq (not started) should wait a step because a request chosen for this chunk
        writes at least DEFER_MIN_TOKENS more of seq's prompt than the cache holds now: next step
        it matches them instead of computing them twice (requests sent together with one system
        prompt). The first request of a chunk is never deferred, so every step makes progress."""
        if self.prefix_cache is None:
            return False
        prompt, la = seq.req.prompt_ids, self.prefix_cache.lookahead
        for other, take in chosen:
            shared = shared_prefix_len(prompt, other.req.prompt_ids)
            if min(shared - la, other.length + take, len(prompt) - 1) - seq.length >= DEFER_MIN_TOKENS:
                return True
        return False

    def _seq_keys(self, seq: _Seq) -> list[int]:
        """The cache keys of every position of seq whose key its known tokens determine (the
        prompt's computed once)."""
        cache, prompt = self.prefix_cache, seq.req.prompt_ids
        if seq.prompt_keys is None:
            seq.prompt_keys = cache.keys(prompt)
        if not seq.tokens:
            return seq.prompt_keys
        return seq.prompt_keys + cache.keys(prompt[len(prompt) - cache.lookahead:] + seq.tokens)

    def _release_slots(self, seq: _Seq, keep: bool = True) -> None:
        """Give back seq's row and slots; with a cache and `keep`, its positions go into the
        tree (copies of positions already there are freed) and its lock is dropped."""
        cache = self.prefix_cache
        if cache is None:
            if seq.row >= 0:
                self.table.free_row(seq.row, seq.length, lag=seq.pending)
            seq.row = -1
            return
        if seq.row >= 0:
            row = self.table.req_to_slot[seq.row]
            keys = self._seq_keys(seq) if keep else []
            # Positions whose key is known (all, once the first token is out) and whose draft
            # K/V is written (not the `pending` ones of adaptive plain steps); none unless keep.
            n = min(seq.length - seq.pending, len(keys)) if keep else seq.cached
            existed = cache.insert(keys[:n], row[:n])[0] if n > seq.cached else n
            if existed > seq.cached:
                self.table.free(row[seq.cached:existed].clone())
            if seq.length > max(n, seq.cached):
                self.table.free(row[max(n, seq.cached):seq.length].clone())
            self.table.free_row(seq.row, 0)
        seq.row = -1
        if seq.cache_node is not None:
            cache.unlock(seq.cache_node)
            seq.cache_node = None

    @property
    def num_running(self) -> int:
        """Requests holding a row: pending, running, held and receiving."""
        return len(self._running) + len(self._pending) + len(self._held) + len(self._receiving)

    @property
    def num_prefilling(self) -> int:
        """Requests whose prompt is not wholly prefilled yet (a step prefills at most
        prefill_chunk_tokens of them)."""
        return len(self._pending)

    @property
    def has_work(self) -> bool:
        """Whether step() would compute anything (or has outputs to give)."""
        return bool(self._running or self._pending or self._stashed)

    # ---- one iteration -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        if self.draft is not None and (self.target.feature_kind, self.target.aux_layers) != self._feature:
            self.target.set_feature(*self._feature)
        if self._stashed:  # a step collected by a call that then failed: its outputs first
            outs, self._stashed = self._stashed, []
            return outs
        decoding = list(self._running.values())
        outputs: dict[str, StepOutput] = {}
        self.decoded_shape = None
        try:
            if self._pending:
                for out in self._prefill(self._prefill_batch()):
                    outputs[out.req_id] = out
            if decoding:
                if self.policy is not None:
                    outs = self._adaptive_decode(decoding)
                elif self.draft is not None:
                    outs = self._decode(decoding, self.spec_shape)
                else:
                    outs = self._decode(decoding, NONE)
                self.decoded_shape = self.spec_shape
                for out in outs:
                    outputs[out.req_id] = out
        except BaseException:
            # A failed forward (e.g. out of memory) leaves every request as it was before the
            # failed phase: retrying or aborting it is exact and no slot is lost.
            self._undo_step()
            raise
        return list(outputs.values())

    def _alloc(self, n: int, host: bool = False) -> torch.Tensor:
        """n slots, on the device (host: a host tensor)."""
        self._make_room(n)
        return self.table.alloc_host(n) if host else self.table.alloc(n)

    def _make_room(self, n: int) -> None:
        """Where fewer than n slots are free: give back the staged next step, then evict from the
        prefix cache."""
        if self.table.num_free < n:
            self._drop_ahead()
        if self.prefix_cache is not None and self.table.num_free < n:
            self.prefix_cache.evict(n - self.table.num_free)

    def _take_slots(self, n: int) -> torch.Tensor:
        slots = self._alloc(n)
        self._step_slots.append(slots)
        return slots

    def _commit_step(self) -> None:
        """The phase's slots now belong to requests (or were freed by it): nothing to undo."""
        self._step_slots.clear()
        self._step_entries.clear()
        self._step_rows.clear()

    def _undo_step(self) -> None:
        self._drop_ahead()
        if self._current is not None:  # launched, its output never read: nothing committed
            self.table.free(self._current.slots)
            self._current = None
        for slots in self._step_slots:
            self.table.free(slots)
        for row, start, end in self._step_entries:
            self.table.req_to_slot[row, start:end] = PAD_SLOT
        for seq in self._step_rows:  # no committed tokens yet: the row goes back empty
            self.table.free_row(seq.row, 0)
            seq.row = -1
        self._commit_step()

    # ---- prefill -----------------------------------------------------------------------------

    def _prefill_batch(self) -> list[tuple[_Seq, int]]:
        """(request, tokens to prefill now) in arrival order, as many as fit one chunk of
        prefill_chunk_tokens padded tokens (B x longest piece); a longer prompt is cut."""
        budget, chosen, q = self.prefill_chunk_tokens, [], 0
        for seq in self._pending:
            if seq.row < 0:
                self._match_prefix(seq)
                if self._defer_for_cache(seq, chosen):
                    continue
            take = min(len(seq.req.prompt_ids) - seq.length, budget)
            if chosen and (len(chosen) + 1) * max(q, take) > budget:
                break
            chosen.append((seq, take))
            q = max(q, take)
        return chosen

    def _prefill(self, chosen: list[tuple[_Seq, int]]) -> list[StepOutput]:
        """One chunk: each chosen request's next `take` prompt tokens, after its earlier chunks
        (the prefix). A request whose prompt ends here samples its first token and starts
        running; the others stay pending with their prefix written."""
        dev = self.device
        b, q = len(chosen), max(take for _, take in chosen)
        tokens = torch.zeros(b, q, dtype=torch.int64, device=dev)
        shifted = torch.zeros(b, q, dtype=torch.int64, device=dev)        # token after each entry
        slots = torch.full((b, q), PAD_SLOT, dtype=torch.int64, device=dev)
        starts = torch.tensor([seq.length for seq, _ in chosen], device=dev)
        takes = torch.tensor([take for _, take in chosen], device=dev)
        for i, (seq, take) in enumerate(chosen):
            if seq.row < 0:
                seq.row = self.table.alloc_row()
                self._step_rows.append(seq)
                seq.num_cached_tokens = seq.length
                if seq.length:  # a prefix cache hit: the tree's slots, locked for this request
                    self.table.req_to_slot[seq.row, :seq.length] = seq.matched_slots
            start, prompt = seq.length, seq.req.prompt_ids
            tokens[i, :take] = torch.tensor(prompt[start:start + take], device=dev)
            # The last prompt entry pairs with the first sampled token, filled in below.
            nxt = prompt[start + 1:start + take + 1]
            shifted[i, :len(nxt)] = torch.tensor(nxt, dtype=torch.int64, device=dev)
            slots[i, :take] = self._take_slots(take)
            self.table.req_to_slot[seq.row, start:start + take] = slots[i, :take]
            self._step_entries.append((seq.row, start, start + take))
        rows = torch.tensor([seq.row for seq, _ in chosen], device=dev)
        prefix = self.table.req_to_slot[rows, :max(seq.length for seq, _ in chosen)]
        positions = starts[:, None] + torch.arange(q, device=dev)
        positions = torch.where(torch.arange(q, device=dev) < takes[:, None], positions, 0)
        batch = causal_batch(slots, takes, prefix, starts)
        out = self.target(tokens, positions, batch, self.target_kv)
        self._prompt_logprobs(chosen, out.hidden)
        done = [i for i, (seq, take) in enumerate(chosen) if seq.length + take == len(seq.req.prompt_ids)]
        finished = [chosen[i][0] for i in done]
        first = first_lps = None
        if done:
            idx = torch.tensor(done, device=dev)
            logits = self.target.logits(out.hidden[idx, takes[idx] - 1])
            process = self._step_logits(finished)
            first = self._sample(finished, process.plain(logits) if process else logits)
            if process is not None and process.wants_logprobs:
                first_lps = process.logprobs(logits[:, None], first[:, None])
            shifted[idx, takes[idx] - 1] = first
            if self.role == "prefill":
                lp = torch.log_softmax(logits.float(), -1).gather(1, first[:, None])[:, 0]
                self.metadata.fixed["output_token_logprob"][rows[idx].cpu()] = lp.cpu()
        if self.draft is not None:
            hidden = self.calls.draft_extend(shifted, out.feature, positions, slots, prefix, starts, takes)
            if done:
                self.draft_hidden[rows[idx]] = hidden[idx]
                if self.policy is not None:
                    self._catch_up_count[rows[idx]] = 0
        for seq, take in chosen:
            self.table.commit(seq.row, seq.length, seq.length + take)
            seq.length += take
        self._commit_step()
        for seq in finished:
            self._pending.remove(seq)
            self._running[seq.req.id] = seq
        outputs = self._emit(finished, [[t] for t in first.tolist()], [0] * len(finished),
                             logprobs=first_lps) if done else []
        for out, seq in zip(outputs, finished):
            out.num_cached_tokens = seq.num_cached_tokens
            out.prompt_logprobs = seq.prompt_lps
        started = [seq for seq in finished if seq.req.id in self._running]
        if started:
            self.rows.start([s.row for s in started], [s.length for s in started], [s.root for s in started])
        if self.prefix_cache is not None:
            for seq, _ in chosen:
                if seq.row >= 0:  # not released (running, pending, or held for export)
                    self._cache_prefix(seq)
        return outputs

    def _prompt_logprobs(self, chosen: list[tuple[_Seq, int]], hidden: torch.Tensor) -> None:
        """Gather the log-probability of each prompt token after the first (from the logits at
        the position before it) for the chunk's requests that asked (echo with logprobs)."""
        for i, (seq, take) in enumerate(chosen):
            if seq.prompt_lps is None:
                continue
            prompt, start = seq.req.prompt_ids, seq.length
            n = min(take, len(prompt) - 1 - start)  # the last prompt position predicts the output
            if n <= 0:
                continue
            nxt = torch.tensor(prompt[start + 1:start + 1 + n], dtype=torch.int64, device=self.device)
            k = seq.req.controls.prompt_logprobs
            # In pieces: a chunk's positions x a large vocabulary of float32 logits at once is GBs.
            for at in range(0, n, _PROMPT_LOGPROBS_ROWS):
                end = min(n, at + _PROMPT_LOGPROBS_ROWS)
                lp, ids, tops = top_logprobs(self.target.logits(hidden[i, at:end]), nxt[at:end], k)
                seq.prompt_lps += [(a, list(zip(b, c))) for a, b, c in zip(lp.tolist(), ids.tolist(), tops.tolist())]

    def _step_logits(self, seqs: list[_Seq]) -> StepLogits | None:
        return StepLogits(seqs, self.target.cfg.vocab_size, self.device) if wants_processing(seqs) else None

    # ---- speculative decoding ------------------------------------------------------------------

    def _adaptive_decode(self, seqs: list[_Seq]) -> list[StepOutput]:
        """One decode step in the shape the policy chooses for this batch size; what it took
        and accepted goes back to the policy."""
        shape = self.policy.choose(len(seqs))
        if self.agree_shape is not None:
            shape = self.agree_shape(shape)
        t0 = time.perf_counter()
        if shape.is_none:
            self._catch_up([s for s in seqs if s.pending >= self.catch_up_tokens])
            outs = self._decode(seqs, shape)
        else:
            self._catch_up([s for s in seqs if s.pending])
            outs = self._decode(seqs, shape)
        self.policy.observe_time(shape, len(seqs), time.perf_counter() - t0)
        self.policy.observe(shape, [o.num_accepted_drafts for o in outs])
        self.spec_shape = shape
        return outs

    def _decode(self, seqs: list[_Seq], shape: SpecShape) -> list[StepOutput]:
        """One decode step of `shape` (plain, or speculative) for every running request.

        Host side: the staged input (made while the previous step ran, when it is this
        step's), one copy to the device, the graph, one copy back; with overlap the next step
        is staged before this one is waited for (assuming every request continues; a request
        that finishes drops it). Then the commit: the slots off the accepted paths go back,
        lengths and tokens are emitted."""
        if self.launch_ahead:
            return self._decode_launch_ahead(seqs, shape)
        key = (shape, tuple(s.row for s in seqs))
        staged, self._ahead = self._ahead, None
        if staged is not None and staged.key != key:
            self.table.free(staged.slots)
            staged = None
        if staged is not None:
            self.num_overlapped_steps += 1
        self._current = step = self._launch(seqs, shape, staged)
        if self.overlap:
            self._ahead = self._stage(step.steps, seqs, key, ahead=True)
        outs = self._collect(step)
        self._current = None
        return outs

    def _decode_launch_ahead(self, seqs: list[_Seq], shape: SpecShape) -> list[StepOutput]:
        """Launch-ahead overlap: the step launched last call (for every request then running)
        is this call's; the next one is launched now, for every request running now, before
        this one is waited for, so that the device never waits for the host between steps.
        A request that this step finishes (or that is aborted) rides one step too many, whose
        output is discarded and whose slots go back when it is collected."""
        step, self._in_flight = self._in_flight, None
        if wants_processing(list(self._running.values())):
            # Controls read each request's tokens so far on the host: no step may be launched
            # before the one before it is collected.
            if step is not None:
                return self._collect(step)
            return self._collect(self._launch(seqs, shape))
        if step is None:
            step = self._launch(seqs, shape)
        else:
            self.num_overlapped_steps += 1
            launched = {id(s) for s in step.seqs}
            if any(id(s) not in launched for s in seqs):
                # A request started between calls (activate): it decodes from the next call,
                # when the pipeline restarts with everyone.
                return self._collect(step)
        ahead = list(self._running.values())
        try:
            self._in_flight = self._launch(ahead, shape, lookahead=self._max_steps + 1) if ahead else None
        except BaseException:
            self._stashed = self._collect(step)  # kept consistent; returned by the next call
            raise
        outs = self._collect(step)
        if not self._running:
            self._drop_in_flight()
        return outs

    def _launch(self, seqs: list[_Seq], shape: SpecShape, staged: _Staged | None = None,
                lookahead: int = 0) -> _Launched:
        """Stage (unless staged), copy and launch one decode step, and queue its output's copy
        to the host; -> the launched step, which owns its slots past the scratch.
        lookahead: positions the requests may have grown by since their host lengths (a step
        launched before the one before it is collected)."""
        steps = self._row_steps[shape]
        b = len(seqs)
        self.num_decode_steps += 1
        if staged is None:
            staged = self._stage(steps, seqs, (shape, tuple(s.row for s in seqs)))
        sampling = any(s.req.temperature > 0 for s in seqs)
        # Prefix columns an eager body reads: the longest committed length.
        width = max(s.length for s in seqs) + lookahead
        taken = staged.slots.view(b, steps.width - 1)
        process = self._step_logits(seqs)
        try:
            if steps.kind == "spec":
                n, m = shape.num_draft_tokens, shape.num_steps
                if sampling:
                    # [B, N + 1 + S]: verify coins per node, the bonus draw, one per chain draft step.
                    params, uniforms = self._sampling_params(seqs), self._uniforms(seqs, n + 1 + m)
                else:
                    params, uniforms = self._greedy_args(b, n + 1 + m)
                out, _ = steps.run(staged.packed, b, width, sampling, params, uniforms, process)
            else:
                out, logits = steps.run(staged.packed, b, width)
                if sampling or process is not None:  # the body wrote the argmax; these replace it
                    tokens = self._sample(seqs, process.plain(logits) if process else logits)
                    if process is not None and process.wants_logprobs:
                        process.recorded = process.logprobs(logits[:, None], tokens[:, None])
                    rows = staged.packed[:b, 0]
                    self.rows.roots[rows] = tokens
                    if steps.kind == "feature":
                        self._catch_up_ids[rows, self._catch_up_count[rows] - 1] = tokens
                    out = tokens[:, None]
        except BaseException:  # a failed forward commits nothing: its slots go back
            self.table.free(staged.slots)
            raise
        scratch = (shape.num_steps - 1) * shape.topk if steps.kind == "spec" else 0
        if scratch:
            # The scratch goes back now: the device is done with it before any later step
            # (one stream), and the next step may take it.
            self.table.free(taken[:, :scratch])
            taken = taken[:, scratch:]
        host, event = self._to_host(out)
        return _Launched(seqs, shape, steps, taken, host, event, getattr(process, "recorded", None))

    def _collect(self, step: _Launched) -> list[StepOutput]:
        """Wait for a launched step's output and commit it on the host: the slots off the
        accepted paths go back, lengths and tokens are emitted. Requests released since the
        launch (finished or aborted: a launch-ahead over-run) give back all its slots."""
        if step.event is not None:
            step.event.synchronize()                         # the one wait of the step
        values = step.host.tolist()
        live = [self._running.get(s.req.id) is s for s in step.seqs]
        shape, b = step.shape, len(step.seqs)
        listeners = self.table.listeners
        if step.steps.kind == "spec":
            n, m = shape.num_draft_tokens, shape.num_steps
            accepted = [v[0] for v in values]
            off_path = step.host[:, 2 + m + 1:].reshape(-1)  # [B * N], sum(N - 1 - accepted) first
            lps = step.logprobs
            if all(live):
                self.table.free(off_path[:b * (n - 1) - sum(accepted)])
            else:
                at = 0
                for i, (ok, a) in enumerate(zip(live, accepted)):
                    self.table.free(off_path[at:at + n - 1 - a] if ok else step.slots[i])
                    at += n - 1 - a
            seqs = [s for s, ok in zip(step.seqs, live) if ok]
            values = [v for v, ok in zip(values, live) if ok]
            lps = [x for x, ok in zip(lps, live) if ok] if lps is not None else None
            accepted = [v[0] for v in values]
            for s, a in zip(seqs, accepted):
                if listeners:
                    self.table.commit(s.row, s.length, s.length + a + 1, lag=(s.pending, s.pending))
                s.length += a + 1
            self._commit_step()
            self.num_draft_tokens_proposed += len(seqs) * m
            self.num_draft_tokens_accepted += sum(accepted)
            emitted = [v[3:a + 3] + [v[1]] for v, a in zip(values, accepted)]
            if lps is not None:
                lps = [x[:a + 1] if x is not None else None for x, a in zip(lps, accepted)]
            return self._emit(seqs, emitted, accepted, m, lps)
        lps = step.logprobs
        if not all(live):
            for i, ok in enumerate(live):
                if not ok:
                    self.table.free(step.slots[i])
            seqs = [s for s, ok in zip(step.seqs, live) if ok]
            values = [v for v, ok in zip(values, live) if ok]
            lps = [x for x, ok in zip(lps, live) if ok] if lps is not None else None
        else:
            seqs = step.seqs
        for s in seqs:
            if listeners:
                lag = s.pending + (step.steps.kind == "feature")
                self.table.commit(s.row, s.length, s.length + 1, lag=(s.pending, lag))
            s.length += 1
            if step.steps.kind == "feature":
                s.pending += 1
        self._commit_step()
        return self._emit(seqs, values, [0] * len(seqs), logprobs=lps)

    def _drop_in_flight(self) -> None:
        """No request is left running: the launched-ahead step's slots go back (the device
        finishes it before any later work that could reuse them) and its output is ignored."""
        if self._in_flight is not None:
            self.table.free(self._in_flight.slots)
            self._in_flight = None

    def _stage(self, steps: RowSteps, seqs: list[_Seq], key: tuple, ahead: bool = False) -> _Staged | None:
        """Take the step's slots, write its packed rows (and padding) into a host buffer and
        start their copy. ahead: for the next step, from free slots only (None if they are
        short: it is staged when it runs instead)."""
        b, width = len(seqs), steps.width
        need = b * (width - 1)
        if ahead and self.table.num_free < need:
            return None
        slots = self.table.alloc_host(need) if ahead else self._alloc(need, host=True)
        bs = steps.bucket(b) or b
        i = self._ring_next
        self._ring_next ^= 1
        if self._ring_events is not None:
            self._ring_events[i].synchronize()              # its last copy has left it
        host = self._ring[i][:bs * width].view(bs, width)
        host[:b, 0] = torch.tensor([s.row for s in seqs], dtype=torch.int64)
        host[:b, 1:] = slots.view(b, width - 1)
        host[b:, 0] = self.table.pad_row
        host[b:, 1:] = PAD_SLOT
        packed = steps.upload(host, b)
        if self._ring_events is not None:
            self._ring_events[i].record()
        return _Staged(key, packed, slots)

    def _drop_ahead(self) -> None:
        """Give back the staged next step's slots (its batch changed, or slots are short)."""
        if self._ahead is not None:
            self.table.free(self._ahead.slots)
            self._ahead = None

    def _to_host(self, out: torch.Tensor) -> tuple[torch.Tensor, object]:
        """out [B, K] on the device -> (its host copy, the event it is done at): on CUDA queued
        into one of two pinned buffers (two steps may be in flight), else a plain copy."""
        if self._out_events is None:
            return (out.cpu() if out.device.type != "cpu" else out), None
        b, k = out.shape
        i = self._out_next
        self._out_next ^= 1
        host = self._out_host[i][:b * k].view(b, k)
        host.copy_(out, non_blocking=True)
        self._out_events[i].record()
        return host, self._out_events[i]

    def _catch_up(self, seqs: list[_Seq]) -> None:
        """The draft runs over the entries its requests' plain steps left (one draft extend of
        catch_up_tokens columns, each row its own count): afterwards its KV and carried hidden
        state are as if it had run after every token. Changes nothing a retry would not redo."""
        if not seqs:
            return
        dev, d = self.device, self.catch_up_tokens
        meta = torch.tensor([[s.row for s in seqs], [s.pending for s in seqs],
                             [s.length - s.pending for s in seqs]], dtype=torch.int64).to(dev)
        rows, count, start = meta[0], meta[1], meta[2]
        cols = torch.arange(d, device=dev)
        valid = cols < count[:, None]                                        # [b, D]
        at = (start[:, None] + cols).clamp(max=self.table.req_to_slot.shape[1] - 1)
        out_slots = torch.where(valid, self.table.req_to_slot[rows[:, None], at], PAD_SLOT)
        positions = torch.where(valid, start[:, None] + cols, 0)
        prefix = self.table.req_to_slot[rows, :max(s.length - s.pending for s in seqs)]
        hidden = self._eager_calls.draft_extend(self._catch_up_ids[rows], self._catch_up_feature[rows],
                                                positions, out_slots, prefix, start, count)
        self.draft_hidden[rows] = hidden
        self._catch_up_count[rows] = 0
        for s in seqs:
            if self.table.listeners:
                self.table.caught_up(s.row, s.length - s.pending, s.length)
            s.pending = 0

    @torch.inference_mode()
    def measure_step_costs(self, buckets: list[int], reps: int = 3) -> dict[tuple[SpecShape, int], float]:
        """Seconds per decode step of every shape at every bucket, timed on padded inputs with
        empty prefixes (every row the padding row; graph replays where captured, eager calls
        otherwise; the median of `reps` after one warm-up). NONE includes 1 / catch_up_tokens
        of a catch-up."""
        dev = self.device
        costs = {}

        def timed(fn) -> float:
            fn()
            times = []
            for _ in range(reps):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2]

        def zeros(*shape, value=0, dtype=torch.int64):
            return torch.full(shape, value, dtype=dtype, device=dev)

        hin = self.target.feature_size
        act = self.draft_hidden.dtype
        for b in buckets:
            prefix, lens = zeros(b, 1, value=PAD_SLOT), zeros(b)
            greedy = self._greedy_params(b)
            for sh in self.shapes:
                steps = self._row_steps[sh]
                # Every row the padding row: empty prefixes, every write to the pad slot.
                host = torch.full((steps.bucket(b) or b, steps.width), PAD_SLOT, dtype=torch.int64)
                host[:, 0] = self.table.pad_row
                packed = steps.upload(host, b)
                if sh.is_none:
                    d = self.catch_up_tokens
                    decode = timed(lambda: steps.run(packed, b, 1))
                    catch_up = timed(lambda: self._eager_calls.draft_extend(
                        zeros(b, d), zeros(b, d, hin, dtype=act), zeros(b, d), zeros(b, d, value=PAD_SLOT),
                        prefix, lens, zeros(b, value=d)))
                    costs[(sh, b)] = decode + catch_up / d
                    continue
                s, _, n = _fields(sh)
                costs[(sh, b)] = timed(lambda: steps.run(packed, b, 1, False, greedy,
                                                         self._greedy_uniforms[:b, :n + 1 + s]))
        return costs

    # ---- sampling and bookkeeping ---------------------------------------------------------------

    def _greedy_params(self, b: int):
        """Sampling parameters of B greedy requests (device constants made once)."""
        return tuple(x[:b] for x in self._greedy)

    def _greedy_args(self, b: int, draws: int):
        """(sampling parameters, uniform draws [B, draws]) of B greedy requests, the views
        made once per (B, draws)."""
        key = (b, draws)
        if key not in self._greedy_views:
            self._greedy_views[key] = (self._greedy_params(b), self._greedy_uniforms[:b, :draws])
        return self._greedy_views[key]

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
            return argmax(logits)
        probs = warp_probs(logits, *self._sampling_params(seqs))
        return sample_from(probs, self._uniforms(seqs, 1)[:, 0])

    def _emit(self, seqs, emitted: list[list[int]], accepted: list[int],
              num_draft_tokens: int = 0, logprobs: list | None = None) -> list[StepOutput]:
        outputs = []
        for i, (s, tokens, acc) in enumerate(zip(seqs, emitted, accepted)):
            s.tokens += tokens  # all committed (+ the root), for the prefix cache's keys
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
            controls = s.req.controls
            if controls is not None and controls.grammar is not None:
                controls.grammar.accept(kept)
            if reason:
                self._release(s, hold=self.role == "prefill")
            lps = logprobs[i] if logprobs is not None else None
            outputs.append(StepOutput(s.req.id, kept, acc, reason is not None, reason,
                                      num_draft_tokens=num_draft_tokens,
                                      logprobs=lps[:len(kept)] if lps is not None else None))
        return outputs


def _fields(shape: SpecShape) -> tuple[int, int, int]:
    return shape.num_steps, shape.topk, shape.num_draft_tokens


def _default_buckets(max_bs: int) -> list[int]:
    """Batch sizes to measure step costs at when nothing is captured: powers of two and max_bs."""
    sizes, b = [], 1
    while b < max_bs:
        sizes.append(b)
        b *= 2
    return sizes + [max_bs]


def _check_buffers_against_plan(allocated: dict, planned) -> None:
    """The engine allocates the plan's static buffers exactly; any difference is a bug in one of
    them (e.g. a buffer sized with hidden_size where spec_hidden_size is meant)."""
    for name, shape in allocated.items():
        want = tuple(getattr(planned, name))
        if shape != want:
            raise ValueError(f"{name}: allocated {shape}, the plan says {want}")

