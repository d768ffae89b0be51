"""What the runtime asks of a target model family (`TargetModel`), and how a family says where
its KV lives (`kv_layout`).

Two layouts today:
- SLOT_ROWS (the Llama family, and every draft head but DeepSeek-V4's MTP): one K/V row per
  token slot in each layer; the runner allocates the pool (memory/kv.py `KVPool`), in the
  model's dtype or as e4m3 codes, and a finished request's slots are reused as they are.
- OWN_POOLS (DeepSeek-V4's target and MTP head): the family keeps a request's recent tokens and
  compressed entries in pools of its own (`make_kv`, memory/compressed_kv.py), trimmed as tokens
  are committed, following the slot table.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

SLOT_ROWS = "slot_rows"
OWN_POOLS = "own_pools"


class TargetModel(Protocol):
    """A target the runner serves: LlamaModel (llama.py) and DeepseekV4Model (deepseek_v4.py)."""

    cfg: Any                        # num_layers, num_kv_heads, head_dim, vocab_size, max_position_embeddings
    kv_layout: str                  # SLOT_ROWS or OWN_POOLS
    tp_rank: int
    tp_size: int
    embed_tokens: torch.nn.Module   # its weight's dtype is the model's
    feature_kind: str | None        # what the draft consumes: "eagle", "eagle3", "mtp" or None
    aux_layers: tuple[int, ...]     # EAGLE-3's three layers (empty otherwise)

    @property
    def feature_size(self) -> int:
        """Width of the feature output: the draft input hidden size."""
        ...

    def set_feature(self, feature_kind: str | None, aux_layers: tuple[int, ...] | None = None) -> None:
        ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any, kv: Any) -> Any:
        """input_ids, positions [B, Q] -> an output with `hidden` [B, Q, H] and `feature` [B, Q, Hin] (or None)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (post-norm) -> [..., vocab] in float32."""
        ...


class OwnPoolsModel(Protocol):
    """A target or draft of kv_layout OWN_POOLS: it makes its pools."""

    def make_kv(self, num_slots: int, max_total_tokens: int, max_running_requests: int,
                in_flight_rows: int, dtype: torch.dtype, device) -> Any:
        ...
