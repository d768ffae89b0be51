"""What a prefill server and a decode server agree on: the handshake's description of a server
(`ServerInfo`, from GET /disagg/info) and the prefill request's body.

Two servers can pair only if the bytes one writes mean the same to the other: the same target
and draft (checked by their shapes: layers, bytes per KV slot, metadata row width, algorithm,
dtype), the same tensor-parallel size (a staging region holds each rank's share, rank after
rank) and the same speculative settings that shape the draft's state. Addresses and slot counts
differ freely.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pydantic import BaseModel, ConfigDict, Field

from specdeploy.engine.serving.fields import INT64_MAX, INT64_MIN

# The header the router names a request's prefill server in (decode servers only).
PREFILL_URL_HEADER = "X-Specdeploy-Prefill-Url"
# Memory regions one decode server may register with a prefill server (its staging arena or KV
# pools, and the metadata buffer's fields: a handful).
MAX_REGISTERED_REGIONS = 256
# How long a decode server waits for a prefill (queueing there included) before giving up.
DEFAULT_PREFILL_TIMEOUT_S = 120.0
# How long an abort sent to a prefill server may take to be acknowledged.
ABORT_ACK_TIMEOUT_S = 5.0
# A prefill server starts no transfer after its deadline; the decode side waits this long past
# the deadline before it reuses slots whose prefill it could not abort (a transfer under way).
TRANSFER_GRACE_S = 10.0


@dataclass(frozen=True)
class ServerInfo:
    role: str
    model: str
    algorithm: str
    dtype: str
    target_kv: tuple                  # runner.kv_signature(): (layers, bytes per slot), or
    draft_kv: tuple | None            # DeepSeek-V4's pools, (name, layers, row bytes, ratio, keep) each
    metadata_width: int               # the plan's metadata row: H_s elements
    num_steps: int
    topk: int
    session_id: str                   # the Mooncake peer to write to / read from
    tensor_parallel_size: int = 1     # ranks whose shares a staging region holds, rank after rank

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ServerInfo:
        d = dict(data)
        d["target_kv"] = _tuples(d["target_kv"])
        d["draft_kv"] = _tuples(d["draft_kv"]) if d.get("draft_kv") else None
        return cls(**d)

    def mismatch(self, other: ServerInfo) -> str | None:
        """Why `other` cannot pair with this server, or None."""
        for name in ("model", "algorithm", "dtype", "tensor_parallel_size", "target_kv", "draft_kv", "metadata_width",
                     "num_steps", "topk"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: {mine} here, {theirs} on the peer"
        return None


def _tuples(value):
    """JSON's lists back into the tuples they were (nested), so that signatures compare equal."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def server_info(role: str, model: str, runner, session_id: str, tensor_parallel_size: int = 1) -> ServerInfo:
    signature = runner.kv_signature()  # rank 0's shard: the other ranks' are alike
    return ServerInfo(role=role, model=model, algorithm=runner.spec.algorithm if runner.draft else "NONE",
                      dtype=str(runner.metadata.hidden.dtype).removeprefix("torch."),
                      target_kv=signature[0], draft_kv=signature[1] if len(signature) > 1 else None,
                      metadata_width=runner.metadata.hidden.shape[1], num_steps=runner.num_steps,
                      topk=runner.topk, session_id=session_id, tensor_parallel_size=tensor_parallel_size)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class PrefillBody(_Body):
    """POST /disagg/prefill: compute this prompt and write its state there."""

    room: str = Field(min_length=1, max_length=128)   # the decode server's name for this transfer
    peer: dict                                          # the decode server's ServerInfo
    prompt_ids: list[int] = Field(min_length=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=INT64_MAX)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    timeout_s: float = Field(DEFAULT_PREFILL_TIMEOUT_S, gt=0)
    slots: list[int]                                    # decode's slot per prompt position
    # decode's PoolLayout of the target and draft pools (slot-row pools only: DeepSeek-V4's move
    # only through `staging`)
    target_kv: dict | None = None
    draft_kv: dict | None = None
    metadata: dict[str, int]                            # decode's metadata row, field -> address
    # decode's staging region for this request ({"address", "bytes"}: transfer.StagedKV's layout),
    # or None: write into the slots of its (registered) pools
    staging: dict[str, int] | None = None


class MemoryRegion(_Body):
    address: int = Field(gt=0)
    bytes: int = Field(gt=0)


class RegisterBody(_Body):
    """POST /disagg/register: a decode server names its Mooncake session and the memory it
    registered with its transfer engine; the prefill server writes only there, and only for
    requests from the address that registered it."""

    peer: dict                                          # the decode server's ServerInfo
    regions: list[MemoryRegion] = Field(min_length=1, max_length=MAX_REGISTERED_REGIONS)


class AbortBody(_Body):
    room: str = Field(min_length=1, max_length=128)
