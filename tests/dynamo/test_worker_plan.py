"""Registration planning (docs/reference/sidecar.md#component-by-mode, docs/reference/sidecar.md#registration-data; docs/reference/worker.md#registration), pure and table-driven.

The expected cards were checked against the model-card records the native 1.6.1 sidecar writes under
``v1/mdc`` (docs/dynamo.md): same model type, worker type, ``needs`` and runtime config, including
``runtime_data`` (the capability flags native registers in every mode).
"""

from __future__ import annotations

import attrs
import pytest

from trio_sidecar.core.config import DisaggregationMode, SidecarConfig, WorkerOptions
from trio_sidecar.core.errors import InvalidArgument
from trio_sidecar.core.model import EngineConfig
from trio_sidecar.core.routing import KvEventSource
from trio_sidecar.dynamo.plan import health_check_payload, plan_registration, worker_namespace

pytestmark = pytest.mark.dynamo

# The upstream reference fixture of docs/reference/sidecar.md#registration-data.
ENGINE = EngineConfig(
    model="model-source",
    served_model_name="served-model",
    aliases=("model-alias",),
    context_length=8192,
    kv_cache_block_size=16,
    total_kv_blocks=4096,
    max_num_seqs=128,
    max_num_batched_tokens=2048,
    data_parallel_size=4,
    data_parallel_start_rank=0,
)
SOURCES = (KvEventSource("tcp://127.0.0.1:20081", "", 0),)


def plan(mode="agg", *, options=None, engine=ENGINE, sources=SOURCES, environ=None, multimodal=False):
    config = SidecarConfig(grpc_endpoint="127.0.0.1:50051", disaggregation_mode=mode)
    return plan_registration(
        config, options or WorkerOptions(), engine, sources, supports_multimodal=multimodal, environ=environ or {}
    )


@pytest.mark.parametrize(
    ("mode", "component", "path", "model_types", "worker_type", "needs", "publisher_indexer"),
    [
        ("agg", "backend", "dynamo.backend.generate", ("Chat", "Completions"), "Aggregated", (), True),
        ("agg", "custom", "dynamo.custom.generate", ("Chat", "Completions"), "Aggregated", (), True),
        ("prefill", "custom", "dynamo.prefill.generate", ("Prefill",), "Prefill", (("Decode",),), True),
        ("decode", "custom", "dynamo.backend.generate", ("Chat", "Completions"), "Decode", (("Prefill",),), False),
    ],
)
def test_component_model_type_worker_type_and_needs_by_mode(
    mode, component, path, model_types, worker_type, needs, publisher_indexer
):
    p = plan(mode, options=WorkerOptions(component=component))
    assert p.endpoint_path == path
    assert p.model_types == model_types
    assert p.worker_type == worker_type
    assert p.needs == needs
    assert p.local_indexer is publisher_indexer
    assert p.runtime_config["enable_local_indexer"] is True


def test_identity_and_capacity_come_from_the_engine_config():
    p = plan()
    assert (p.model_path, p.served_model_name, p.aliases) == ("model-source", "served-model", ("model-alias",))
    assert p.kv_cache_block_size == 16
    assert p.runtime_config == {
        "context_length": 8192,
        "total_kv_blocks": 4096,
        "max_num_seqs": 128,
        "max_num_batched_tokens": 2048,
        "data_parallel_size": 4,
        "data_parallel_start_rank": 0,
        "runtime_data": {"lora_requires_registration": True, "vllm_inference_v1_generate": True},
        "exclude_tools_when_tool_choice_none": True,
        "enable_local_indexer": True,
    }
    # Control's parser names are never advertised (docs/reference/sidecar.md#registration-data).
    assert "tool_call_parser" not in p.runtime_config and "reasoning_parser" not in p.runtime_config


@pytest.mark.parametrize("mode", ["agg", "prefill", "decode"])
def test_configured_parsers_are_registered_in_every_mode(mode):
    options = WorkerOptions(tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    p = plan(mode, options=options)
    assert (p.runtime_config["tool_call_parser"], p.runtime_config["reasoning_parser"]) == ("hermes", "deepseek_r1")
    assert "reasoning_parser" not in plan(options=WorkerOptions(tool_call_parser="")).runtime_config
    assert plan(options=WorkerOptions(tool_call_parser="")).runtime_config["tool_call_parser"] == ""


def test_unknown_limits_are_left_at_dynamo_defaults():
    engine = EngineConfig(
        model="m",
        served_model_name="m",
        aliases=(),
        context_length=None,
        kv_cache_block_size=None,
        total_kv_blocks=None,
        max_num_seqs=None,
        max_num_batched_tokens=None,
        data_parallel_size=None,
        data_parallel_start_rank=None,
    )
    p = plan(engine=engine, sources=())
    assert p.kv_cache_block_size is None
    assert p.aliases == ()
    assert p.runtime_config == {
        "runtime_data": {"lora_requires_registration": True, "vllm_inference_v1_generate": True},
        "exclude_tools_when_tool_choice_none": True,
        "enable_local_indexer": True,
    }


@pytest.mark.parametrize(
    ("types", "expected"),
    [
        ("chat", ("Chat",)),
        ("completions", ("Completions",)),
        ("completions,chat", ("Completions", "Chat")),
        ("chat,embeddings", ("Chat", "Embedding")),
        ("embeddings", ("Embedding",)),
    ],
)
def test_endpoint_types_map_to_model_type_flags(types, expected):
    assert plan(options=WorkerOptions(endpoint_types=types)).model_types == expected


def test_an_unknown_endpoint_type_is_rejected():
    with pytest.raises(InvalidArgument, match="unknown endpoint type 'rerank'"):
        plan(options=WorkerOptions(endpoint_types="chat,rerank"))


def test_template_and_exclude_tools_are_passed_through():
    p = plan(options=WorkerOptions(custom_jinja_template="/t.jinja", exclude_tools_when_tool_choice_none=False))
    assert p.custom_template_path == "/t.jinja"
    assert p.runtime_config["exclude_tools_when_tool_choice_none"] is False


@pytest.mark.parametrize(
    ("namespace", "suffix", "expected"),
    [
        ("dynamo", "", "dynamo"),
        ("dynamo", "blue", "dynamo-blue"),
        ("dynamo-blue", "blue", "dynamo-blue"),
        ("ns", " ", "ns"),
    ],
)
def test_namespace_worker_suffix_is_appended_once(namespace, suffix, expected):
    assert worker_namespace(namespace, {"DYN_NAMESPACE_WORKER_SUFFIX": suffix}) == expected
    p = plan(options=WorkerOptions(namespace=namespace), environ={"DYN_NAMESPACE_WORKER_SUFFIX": suffix})
    assert p.endpoint_path == f"{expected}.backend.generate"


def test_encode_mode_needs_a_multimodal_engine():
    with pytest.raises(InvalidArgument) as info:
        plan(DisaggregationMode.ENCODE)
    assert str(info.value) == (
        "encode mode requires a multimodal engine; `served-model` does not advertise multimodal support"
    )


def test_an_encode_worker_registers_like_natives():
    p = plan(DisaggregationMode.ENCODE, options=WorkerOptions(component="custom"), multimodal=True)
    assert p.endpoint_path == "dynamo.encode.generate"
    assert (p.model_types, p.worker_type) == (("Empty",), "Encode")
    assert p.needs == (("Prefill", "Decode"), ("Aggregated",))
    assert p.kv_cache_block_size is None and not p.local_indexer
    assert "total_kv_blocks" not in p.runtime_config
    assert p.runtime_config["enable_local_indexer"] is False
    assert "kv_event_publishing_enabled" not in p.runtime_config
    assert not p.encoder_result_handoff


@pytest.mark.parametrize(("mode", "needs"), [("agg", (("Encode",),)), ("prefill", (("Decode", "Encode"),))])
def test_route_to_encoder_adds_the_encode_peer_and_the_handoff_capability(mode, needs):
    p = plan(mode, options=WorkerOptions(route_to_encoder=True), multimodal=True)
    assert p.needs == needs and p.encoder_result_handoff
    assert not plan(mode).encoder_result_handoff


@pytest.mark.parametrize("mode", ["decode", "encode"])
def test_route_to_encoder_on_decode_or_encode_is_refused_with_natives_text(mode):
    with pytest.raises(InvalidArgument) as info:
        plan(mode, options=WorkerOptions(route_to_encoder=True), multimodal=True)
    assert str(info.value) == (
        f"--route-to-encoder is meaningful only for --disaggregation-mode agg|prefill; got '{mode}'. Decode workers "
        "consume KV cache from a Prefill peer (encoder dependency propagates transitively through Prefill); "
        "Encode workers are the producer of the encoder result."
    )


def test_health_check_payload_uses_the_models_bos_token_and_the_canary_marker(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"bos_token_id": 0, "eos_token_id": 1}')
    payload = health_check_payload(str(tmp_path), {})
    assert payload == {
        "token_ids": [0],
        "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
        "sampling_options": {"temperature": 0.0},
        "_HEALTH_CHECK": True,
    }
    assert health_check_payload("org/hub-model-id", {})["token_ids"] == [1]  # not a readable directory


def test_health_check_payload_env_override(tmp_path):
    override = '{"token_ids": [7, 8], "stop_conditions": {"max_tokens": 2}}'
    assert health_check_payload("m", {"DYN_HEALTH_CHECK_PAYLOAD": override}) == {
        "token_ids": [7, 8],
        "stop_conditions": {"max_tokens": 2},
        "_HEALTH_CHECK": True,
    }
    path = tmp_path / "hc.json"
    path.write_text('{"token_ids": [9]}')
    assert health_check_payload("m", {"DYN_HEALTH_CHECK_PAYLOAD": f"@{path}"})["token_ids"] == [9]
    # Unreadable or non-object overrides fall back to the default.
    assert health_check_payload("m", {"DYN_HEALTH_CHECK_PAYLOAD": "[1, 2]"})["token_ids"] == [1]
    assert health_check_payload("m", {"DYN_HEALTH_CHECK_PAYLOAD": "{not json"})["token_ids"] == [1]


def test_a_canary_payload_is_registered_only_when_dynamo_health_checks_are_enabled():
    assert plan(environ={}).health_check_payload is None
    assert plan(environ={"DYN_HEALTH_CHECK_ENABLED": "false"}).health_check_payload is None
    enabled = plan(environ={"DYN_HEALTH_CHECK_ENABLED": "true"}).health_check_payload
    assert enabled is not None and enabled["_HEALTH_CHECK"] is True


def test_the_capability_flags_are_registered_in_every_mode_and_kv_publishing_is_not_advertised():
    no_block = attrs.evolve(ENGINE, kv_cache_block_size=None)
    for p in (plan(sources=SOURCES), plan(sources=()), plan(engine=no_block, sources=SOURCES)):
        assert p.runtime_config["runtime_data"] == {
            "lora_requires_registration": True,
            "vllm_inference_v1_generate": True,
        }
        assert "kv_event_publishing_enabled" not in p.runtime_config
