"""Worker planning (pure): what ``register_model`` and the KV publishers need, from the start-phase
``EngineConfig`` and the options (docs/reference/worker.md#registration). No Dynamo, no Trio."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ..core.config import DisaggregationMode, SidecarConfig, WorkerOptions, model_type_names
from ..core.errors import InvalidArgument

if TYPE_CHECKING:
    from ..core.model import EngineConfig
    from ..core.routing import KvEventSource

__all__ = [
    "HEALTH_CHECK_KEY",
    "WorkerPlan",
    "endpoint_path",
    "health_check_payload",
    "plan_registration",
    "worker_namespace",
]

LOGGER = logging.getLogger("trio_sidecar.dynamo.plan")

_WORKER_TYPES = {
    DisaggregationMode.AGG: "Aggregated",
    DisaggregationMode.PREFILL: "Prefill",
    DisaggregationMode.DECODE: "Decode",
    DisaggregationMode.ENCODE: "Encode",
}
_FIXED_COMPONENT = {
    DisaggregationMode.PREFILL: "prefill",
    DisaggregationMode.DECODE: "backend",
    DisaggregationMode.ENCODE: "encode",
}
# register_model rejects Prefill/Decode without `needs`; the native sidecar declares the peer role. An encode
# worker serves a prefill/decode pair or an aggregated worker.
_NEEDS = {
    DisaggregationMode.PREFILL: (("Decode",),),
    DisaggregationMode.DECODE: (("Prefill",),),
    DisaggregationMode.ENCODE: (("Prefill", "Decode"), ("Aggregated",)),
}
# Native 1.6.1's texts for the encoder checks made once the engine is known (exit 1).
ENCODE_NEEDS_MULTIMODAL = "encode mode requires a multimodal engine; `{model}` does not advertise multimodal support"
ROUTE_TO_ENCODER_MODE = (
    "--route-to-encoder is meaningful only for --disaggregation-mode agg|prefill; got '{mode}'. Decode workers "
    "consume KV cache from a Prefill peer (encoder dependency propagates transitively through Prefill); Encode "
    "workers are the producer of the encoder result."
)


def worker_namespace(namespace: str, environ: Mapping[str, str] = os.environ) -> str:
    """Apply ``DYN_NAMESPACE_WORKER_SUFFIX`` like the native sidecar: ``-{suffix}`` unless empty or present."""
    suffix = environ.get("DYN_NAMESPACE_WORKER_SUFFIX", "").strip()
    if not suffix or namespace.endswith(f"-{suffix}"):
        return namespace
    return f"{namespace}-{suffix}"


@attrs.frozen(kw_only=True)
class WorkerPlan:
    """Everything ``register_model`` and the publishers need, as plain values (docs/reference/worker.md#registration)."""

    endpoint_path: str  # "ns.component.endpoint"
    model_path: str
    served_model_name: str
    aliases: tuple[str, ...]
    model_types: tuple[str, ...]  # dynamo.llm.ModelType member names, OR-ed together ("Prefill" for prefill)
    worker_type: str  # dynamo.llm.WorkerType member name
    needs: tuple[tuple[str, ...], ...]  # DNF of WorkerType names the role depends on (required for P/D)
    kv_cache_block_size: int | None
    #: The base card's LoRA slot count whenever vLLM supports LoRA (``DYN_LORA_ENABLED`` or not), as native.
    max_gpu_lora_count: int | None
    runtime_config: dict[str, Any]  # ModelRuntimeConfig attributes to set (None values already dropped)
    custom_template_path: str | None
    # Dynamo's canary request, only when canaries are enabled (DYN_HEALTH_CHECK_ENABLED): with a payload the
    # runtime derives /health from endpoint health and ignores set_health_status (docs/dynamo.md).
    health_check_payload: dict[str, Any] | None
    local_indexer: bool  # KvEventPublisher(enable_local_indexer=...): off for decode workers
    # runtime_data.encoder_result_handoff: this worker takes an encode worker's result (--route-to-encoder).
    encoder_result_handoff: bool = False


def plan_registration(
    config: SidecarConfig,
    options: WorkerOptions,
    engine: EngineConfig,
    sources: Sequence[KvEventSource],
    *,
    supports_multimodal: bool = False,
    environ: Mapping[str, str] = os.environ,
) -> WorkerPlan:
    """Build the registration from the start-phase ``EngineConfig`` (docs/reference/sidecar.md#registration-data, docs/reference/worker.md#registration).

    Encoder disaggregation (docs/reference/worker.md#encoder-disaggregation): an encode worker needs a
    multimodal engine, registers ``WorkerType.Encode`` with no OpenAI surface, no KV block size and no local
    indexer; ``--route-to-encoder`` (aggregated and prefill workers only) adds the encode peer to ``needs``
    and advertises ``runtime_data.encoder_result_handoff``.

    Raises:
        InvalidArgument: an unknown endpoint type, or an encoder setting the engine or the mode cannot serve
            (native's texts).
    """
    mode = DisaggregationMode.parse(config.disaggregation_mode)
    if mode is DisaggregationMode.ENCODE and not supports_multimodal:
        raise InvalidArgument(ENCODE_NEEDS_MULTIMODAL.format(model=engine.served_model_name))
    if options.route_to_encoder and mode not in (DisaggregationMode.AGG, DisaggregationMode.PREFILL):
        raise InvalidArgument(ROUTE_TO_ENCODER_MODE.format(mode=mode.value))
    component = _FIXED_COMPONENT.get(mode, options.component)
    path = f"{worker_namespace(options.namespace, environ)}.{component}.{options.endpoint}"
    if mode is DisaggregationMode.ENCODE:
        model_types: tuple[str, ...] = ("Empty",)  # not on the public chat/completions surface
    elif mode is DisaggregationMode.PREFILL:
        # Prefill workers have no OpenAI surface whatever --endpoint-types says; like the native sidecar
        # they register the legacy ModelType.Prefill marker (so older frontends still see the role) and
        # WorkerType.Prefill.
        model_types = ("Prefill",)
    else:
        model_types = model_type_names(options.endpoint_types)
    limits = {
        "context_length": engine.context_length,
        "total_kv_blocks": engine.total_kv_blocks,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "data_parallel_size": engine.data_parallel_size,
        "data_parallel_start_rank": engine.data_parallel_start_rank,
    }
    runtime: dict[str, Any] = {k: v for k, v in limits.items() if v is not None}
    # Capability flags native 1.6.1 writes in every mode: LoRA adapters must be registered before use, and
    # the worker speaks vLLM's v1 generate protocol.
    runtime["runtime_data"] = dict(RUNTIME_DATA)
    runtime["exclude_tools_when_tool_choice_none"] = bool(options.exclude_tools_when_tool_choice_none)
    # The frontend's parsers, only as the operator configured them (Control's names are never defaults).
    for key in ("tool_call_parser", "reasoning_parser"):
        if getattr(options, key) is not None:
            runtime[key] = getattr(options, key)
    # The native 1.6.1 sidecar's model card says enable_local_indexer=true in every mode; decode workers
    # get no KV publishers anyway (vLLM reports no KV-event sources in decode mode).
    runtime["enable_local_indexer"] = mode is not DisaggregationMode.ENCODE
    local_indexer = mode not in (DisaggregationMode.DECODE, DisaggregationMode.ENCODE)
    needs = _NEEDS.get(mode, ())
    if options.route_to_encoder:
        needs = tuple((*group, "Encode") for group in needs) or (("Encode",),)
    if mode is DisaggregationMode.ENCODE:  # the encoder keeps no KV for the router
        runtime.pop("total_kv_blocks", None)
    return WorkerPlan(
        endpoint_path=path,
        model_path=engine.model,
        served_model_name=engine.served_model_name,
        aliases=tuple(engine.aliases),
        model_types=model_types,
        worker_type=_WORKER_TYPES[mode],
        needs=needs,
        kv_cache_block_size=None if mode is DisaggregationMode.ENCODE else engine.kv_cache_block_size,
        max_gpu_lora_count=engine.max_gpu_lora_count,
        runtime_config=runtime,
        custom_template_path=options.custom_jinja_template,
        health_check_payload=(
            health_check_payload(engine.model, environ) if _truthy(environ.get("DYN_HEALTH_CHECK_ENABLED")) else None
        ),
        local_indexer=local_indexer,
        encoder_result_handoff=options.route_to_encoder,
    )


HEALTH_CHECK_KEY = "_HEALTH_CHECK"
#: ``runtime_config.runtime_data`` as Dynamo 1.6.1's native vLLM sidecar registers it.
RUNTIME_DATA = {"lora_requires_registration": True, "vllm_inference_v1_generate": True}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def health_check_payload(model_path: str, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The canary request Dynamo sends when its health checks are enabled (``DYN_HEALTH_CHECK_ENABLED``).

    Dynamo's token-input backends use one BOS token, ``max_tokens`` 1, ``ignore_eos``, temperature 0, and
    the ``_HEALTH_CHECK`` marker; ``DYN_HEALTH_CHECK_PAYLOAD`` (JSON, or ``@file``) overrides it. The BOS id
    comes from the model directory's ``generation_config.json``/``config.json`` when readable, else 1.
    Canaries are served like any other request (docs/reference/worker.md#health-canaries).
    """
    payload: dict[str, Any] = {
        "token_ids": [_bos_token_id(model_path)],
        "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
        "sampling_options": {"temperature": 0.0},
    }
    override = environ.get("DYN_HEALTH_CHECK_PAYLOAD", "").strip()
    if override:
        try:
            if override.startswith("@"):
                with open(override[1:], encoding="utf-8") as f:
                    parsed = json.load(f)
            else:
                parsed = json.loads(override)
        except (OSError, ValueError) as exc:
            LOGGER.warning("ignoring DYN_HEALTH_CHECK_PAYLOAD: %s", exc)
        else:
            if isinstance(parsed, dict):
                payload = parsed
            else:
                LOGGER.warning("ignoring DYN_HEALTH_CHECK_PAYLOAD: not a JSON object")
    return {**payload, HEALTH_CHECK_KEY: True}


def _bos_token_id(model_path: str) -> int:
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(model_path, name), encoding="utf-8") as f:
                value = json.load(f).get("bos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 1


def endpoint_path(config: SidecarConfig, options: WorkerOptions, environ: Mapping[str, str] = os.environ) -> str:
    """``ns.component.endpoint`` for the worker's mode (prefill and decode have fixed components)."""
    mode = DisaggregationMode.parse(config.disaggregation_mode)
    component = _FIXED_COMPONENT.get(mode, options.component)
    return f"{worker_namespace(options.namespace, environ)}.{component}.{options.endpoint}"
