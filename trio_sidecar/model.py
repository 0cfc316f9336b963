"""Discovered model metadata and identity (docs/reference/sidecar.md#control-metadata-validation). PURE: no I/O, no Trio.

Mirrors upstream ``model.rs``: ``DiscoveredModel.from_proto`` validates Control's answers once, and the
rest of the sidecar only reads the validated object.
"""

from __future__ import annotations

from typing import Any

import attrs

from ._proto.vllm import control_pb2
from .errors import ProtocolError

__all__ = [
    "ModelIdentity",
    "DiscoveredModel",
    "EngineConfig",
    "ensure_startup_compatible",
    "engine_config",
    "nz",
]


@attrs.frozen
class ModelIdentity:
    """What must not change between bootstrap and start (docs/reference/sidecar.md#control-metadata-validation). Alias order matters."""

    model_id: str
    served_model_name: str
    served_model_aliases: tuple[str, ...]
    reasoning_parser: str | None
    tool_call_parser: str | None


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
            if par.data_parallel_size == 0:
                raise ProtocolError("vLLM reports a data-parallel size of zero")
            if par.data_parallel_rank != 0:
                raise ProtocolError(
                    f"vLLM reports data_parallel_rank {par.data_parallel_rank}; the sidecar currently requires "
                    "one frontend hosting the complete data-parallel group starting at rank 0"
                )
            if par.data_parallel_size_local not in (0, par.data_parallel_size):
                raise ProtocolError(
                    f"vLLM reports data_parallel_size_local {par.data_parallel_size_local} for data_parallel_size "
                    f"{par.data_parallel_size}; hybrid data-parallel load balancing is not supported yet"
                )
        identity = ModelIdentity(
            model_id=model_info.model_id,
            served_model_name=model_info.served_model_name,
            served_model_aliases=tuple(model_info.served_model_aliases),
            reasoning_parser=_blank_to_none(model_info.reasoning_parser),
            tool_call_parser=_blank_to_none(model_info.tool_call_parser),
        )
        return cls(identity=identity, model_info=_copy(model_info), server_info=_copy(server_info))

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
        """``parallelism.data_parallel_size`` when ``parallelism`` is present, else 1."""
        if self.server_info.HasField("parallelism"):
            return self.server_info.parallelism.data_parallel_size
        return 1


def ensure_startup_compatible(bootstrap: DiscoveredModel, observed: DiscoveredModel) -> None:
    """docs/reference/sidecar.md#identity-check: the start-phase model must have the bootstrap identity and DP size.

    Raises:
        ProtocolError: identity or DP size changed.
    """
    if bootstrap.identity != observed.identity:
        raise ProtocolError(
            "model identity changed between bootstrap and startup: "
            f"expected {bootstrap.identity!r}, observed {observed.identity!r}"
        )
    if bootstrap.data_parallel_size() != observed.data_parallel_size():
        raise ProtocolError(
            "data-parallel size changed between bootstrap and startup: "
            f"expected {bootstrap.data_parallel_size()}, observed {observed.data_parallel_size()}"
        )


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
    tool_call_parser: None = None
    reasoning_parser: None = None


def engine_config(model: DiscoveredModel) -> EngineConfig:
    """Build the registration fields of docs/reference/sidecar.md#registration-data (``nz()`` turns unknown zero limits into ``None``)."""
    info = model.server_info
    if info.HasField("parallelism"):
        dp_size: int | None = nz(info.parallelism.data_parallel_size)
        dp_start: int | None = 0
    else:
        dp_size = dp_start = None
    return EngineConfig(
        model=model.model_id,
        served_model_name=model.served_model_name,
        aliases=model.served_model_aliases,
        context_length=nz(info.max_model_len),
        kv_cache_block_size=nz(info.kv_block_size),
        total_kv_blocks=nz(info.total_kv_blocks),
        max_num_seqs=nz(info.max_running_requests),
        max_num_batched_tokens=nz(info.max_batched_tokens),
        data_parallel_size=dp_size,
        data_parallel_start_rank=dp_start,
    )
