"""Discovered model metadata and identity (docs/reference/sidecar.md#control-metadata-validation). PURE: no I/O, no Trio.

Mirrors upstream ``model.rs``: ``DiscoveredModel.from_proto`` validates Control's answers once, and the
rest of the sidecar only reads the validated object.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
from google.protobuf import text_format

from .._proto.vllm import control_pb2
from .errors import ProtocolError

LOGGER = logging.getLogger("trio_sidecar.model")

__all__ = [
    "ModelIdentity",
    "DiscoveredModel",
    "EngineConfig",
    "ensure_startup_compatible",
    "engine_config",
    "nz",
    "local_data_parallel_range",
]


@attrs.frozen
class ModelIdentity:
    """What must not change between bootstrap and start (docs/reference/sidecar.md#control-metadata-validation). Alias order matters."""

    model_id: str
    served_model_name: str
    served_model_aliases: tuple[str, ...]
    reasoning_parser: str | None
    tool_call_parser: str | None
    supports_lora: bool = False
    max_loras: int = 0
    supports_multimodal: bool = False


def _blank_to_none(value: str) -> str | None:
    return None if not value.strip() else value


def _copy(message: Any) -> Any:
    clone = type(message)()
    clone.CopyFrom(message)
    return clone


@attrs.frozen
class DiscoveredModel:
    """A validated ``ModelInfo`` + ``ServerInfo`` pair (docs/reference/sidecar.md#control-metadata-validation). Build it with :meth:`from_proto`."""

    identity: ModelIdentity
    model_info: control_pb2.ModelInfo = attrs.field(eq=False, repr=False)
    server_info: control_pb2.ServerInfo = attrs.field(eq=False, repr=False)
    #: The data-parallel ranks this vLLM hosts (all of them unless it is one node of a hybrid DP group).
    local_ranks: range = range(0, 1)

    @classmethod
    def from_proto(cls, model_info: control_pb2.ModelInfo, server_info: control_pb2.ServerInfo) -> DiscoveredModel:
        """Validate Control metadata in the order (docs/reference/sidecar.md#control-metadata-validation).

        Raises:
            ProtocolError: ``invalid vLLM gRPC response: ...`` with the texts (docs/reference/sidecar.md#control-metadata-validation).
        """
        if server_info.api_version != "vllm":
            raise ProtocolError(f"unsupported Control API version `{server_info.api_version}`; expected `vllm`")
        if not model_info.model_id.strip():
            raise ProtocolError("Control returned an empty model_id")
        if not model_info.served_model_name.strip():
            raise ProtocolError("Control returned an empty served_model_name")
        if not model_info.supports_token_ids_input:
            raise ProtocolError("the discovered model does not support token-ID input")
        if server_info.HasField("parallelism"):
            par = server_info.parallelism
            ranks = local_data_parallel_range(
                par.data_parallel_size, par.data_parallel_rank, par.data_parallel_size_local
            )
        else:
            ranks = range(0, 1)
        identity = ModelIdentity(
            model_id=model_info.model_id,
            served_model_name=model_info.served_model_name,
            served_model_aliases=tuple(model_info.served_model_aliases),
            reasoning_parser=_blank_to_none(model_info.reasoning_parser),
            tool_call_parser=_blank_to_none(model_info.tool_call_parser),
            supports_lora=model_info.supports_lora,
            max_loras=server_info.max_loras,
            supports_multimodal=model_info.supports_multimodal,
        )
        return cls(identity=identity, model_info=_copy(model_info), server_info=_copy(server_info), local_ranks=ranks)

    # Convenience accessors (the identity holds the original, untrimmed strings).
    @property
    def model_id(self) -> str:
        return self.identity.model_id

    @property
    def served_model_name(self) -> str:
        return self.identity.served_model_name

    @property
    def served_model_aliases(self) -> tuple[str, ...]:
        return self.identity.served_model_aliases

    @property
    def supports_lora(self) -> bool:
        """The server advertises LoRA support with room for at least one adapter (``max_loras`` > 0)."""
        return bool(self.model_info.supports_lora) and self.server_info.max_loras > 0

    @property
    def supports_multimodal(self) -> bool:
        return self.model_info.supports_multimodal

    @property
    def instance_id(self) -> str:
        return self.server_info.instance_id

    @property
    def kv_block_size(self) -> int:
        return self.server_info.kv_block_size

    def data_parallel_size(self) -> int:
        """The number of data-parallel ranks this vLLM hosts (``local_ranks``), 1 without ``parallelism``."""
        return len(self.local_ranks)


def local_data_parallel_range(global_size: int, start: int, local_size: int) -> range:
    """The DP ranks one vLLM hosts, from ``ParallelismInfo`` (docs/reference/sidecar.md#data-parallel-rank).

    ``data_parallel_rank`` is the first hosted rank and ``data_parallel_size_local`` their number; a local
    size of 0 means "not reported" (older vLLM) and is only accepted from rank 0, as the whole group. Same
    rules and texts as Dynamo 1.6.1's native sidecar.

    Raises:
        ProtocolError: a zero DP size, a missing local size off rank 0, or a range outside the group.
    """
    if global_size == 0:
        raise ProtocolError("vLLM reports a data-parallel size of zero")
    if local_size == 0:
        if start != 0:
            raise ProtocolError(
                f"vLLM reports data_parallel_rank {start} without data_parallel_size_local; hybrid rank "
                "ownership requires the local-size Control field"
            )
        if global_size > 1:
            LOGGER.warning(
                "vLLM omits data_parallel_size_local; assuming this frontend hosts the entire DP group. Hybrid "
                "deployments require a vLLM build that reports local DP size to avoid registering unhosted "
                "ranks and underestimating per-rank KV capacity"
            )
        local_size = global_size
    if start + local_size > global_size:
        raise ProtocolError(
            f"vLLM reports an invalid local data-parallel range: start {start}, local size {local_size}, "
            f"global size {global_size}"
        )
    return range(start, start + local_size)


def ensure_startup_compatible(bootstrap: DiscoveredModel, observed: DiscoveredModel) -> None:
    """docs/reference/sidecar.md#identity-check: the start-phase model must have the bootstrap identity (with
    LoRA and multimodal support), parallelism and RL capabilities, in that order, with native 1.6.1's texts.

    Raises:
        ProtocolError: what changed.
    """
    if bootstrap.identity != observed.identity:
        raise ProtocolError(
            "model identity changed between bootstrap and startup: "
            f"expected {bootstrap.identity!r}, observed {observed.identity!r}"
        )
    for field, what in (("parallelism", "parallelism"), ("rl_capabilities", "RL capabilities")):
        expected, seen = _optional(bootstrap.server_info, field), _optional(observed.server_info, field)
        if expected != seen:
            raise ProtocolError(
                f"{what} changed between bootstrap and startup: expected {_show(expected)}, observed {_show(seen)}"
            )


def _optional(message: Any, field: str) -> Any:
    return getattr(message, field) if message.HasField(field) else None


def _show(message: Any) -> str:
    if message is None:
        return "None"
    return f"{type(message).__name__}({text_format.MessageToString(message, as_one_line=True)})"


def nz(value: int) -> int | None:
    """``None`` for 0 (an unknown server limit), else the value (docs/reference/sidecar.md#registration-data)."""
    return None if value == 0 else value


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Registration data (docs/reference/sidecar.md#registration-data): identity from the model, capacity from the start-phase ``ServerInfo``.

    Control's parser names are never advertised: the registered parsers are only those the operator
    configures (``WorkerOptions.tool_call_parser`` / ``reasoning_parser``).
    """

    model: str
    served_model_name: str
    aliases: tuple[str, ...]
    context_length: int | None
    kv_cache_block_size: int | None
    total_kv_blocks: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    data_parallel_size: int | None
    data_parallel_start_rank: int | None
    max_gpu_lora_count: int | None = None  # ``max_loras`` when the server supports LoRA
    tool_call_parser: None = None
    reasoning_parser: None = None


def engine_config(model: DiscoveredModel) -> EngineConfig:
    """Build the registration fields of docs/reference/sidecar.md#registration-data (``nz()`` turns unknown zero limits into ``None``).

    Like Dynamo 1.6.1's native sidecar: the block size is vLLM's effective attention block size when it
    reports one (hybrid-attention models), the DP size and start rank are the hosted ranks, and the KV
    capacity is per hosted rank (vLLM sums its ranks' blocks).

    Raises:
        ProtocolError: an ``effective_attention_block_size`` of 0 or beyond u32.
    """
    info = model.server_info
    if info.HasField("parallelism"):
        dp_size: int | None = len(model.local_ranks)
        dp_start: int | None = model.local_ranks.start
    else:
        dp_size = dp_start = None
    return EngineConfig(
        model=model.model_id,
        served_model_name=model.served_model_name,
        aliases=model.served_model_aliases,
        context_length=nz(info.max_model_len),
        kv_cache_block_size=_kv_cache_block_size(info),
        total_kv_blocks=_total_kv_blocks_per_rank(info.total_kv_blocks, len(model.local_ranks)),
        max_num_seqs=nz(info.max_running_requests),
        max_num_batched_tokens=nz(info.max_batched_tokens),
        data_parallel_size=dp_size,
        data_parallel_start_rank=dp_start,
        max_gpu_lora_count=info.max_loras if model.supports_lora else None,
    )


def _kv_cache_block_size(info: control_pb2.ServerInfo) -> int | None:
    if not info.HasField("effective_attention_block_size"):
        return nz(info.kv_block_size)
    size = info.effective_attention_block_size
    if not 0 < size < 2**32:
        raise ProtocolError(
            f"invalid effective_attention_block_size {size}; KV routing requires a nonzero size that fits u32"
        )
    return size


def _total_kv_blocks_per_rank(total: int, ranks: int) -> int | None:
    if total == 0:
        return None
    per_rank = total // ranks
    if per_rank == 0:
        LOGGER.warning("vLLM reported fewer total KV blocks than DP ranks; publishing one block per rank")
        return 1
    if total % ranks:
        LOGGER.warning(
            "vLLM aggregate KV blocks are not divisible by DP ranks; publishing floor per-rank capacity "
            "(total_kv_blocks=%d data_parallel_size=%d per_rank=%d)",
            total,
            ranks,
            per_rank,
        )
    return per_rank
