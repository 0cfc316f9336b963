"""Pin every message, field number, type and label of the wire contract (docs/reference/wire.md#services-and-methods, docs/reference/wire.md#health).

The table below is this project's own copy of the contract; the generated descriptors must match it
exactly, so an accidental renumbering (the 2d2c3af fork collision of docs/reference/wire.md#field-number-history) fails here.
"""

from __future__ import annotations

import pytest
from google.protobuf import descriptor as _d

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import control_pb2, inference_pb2

# (number, name, type, label). type: scalar name, "msg:Name" or "enum:Name"; label: "" (implicit),
# "optional" (proto3 explicit presence), "repeated", "map", or "oneof:<name>".
INFERENCE: dict[str, list[tuple[int, str, str, str]]] = {
    "GenerateRequest": [
        (1, "request_id", "string", ""),
        (2, "model", "string", ""),
        (3, "text", "string", "oneof:prompt"),
        (4, "token_ids", "msg:TokenIds", "oneof:prompt"),
        (5, "temperature", "float", "optional"),
        (6, "sampling", "msg:RandomSampling", ""),
        (7, "decoding", "msg:DecodingParameters", ""),
        (8, "stopping", "msg:StoppingCriteria", ""),
        (9, "response", "msg:ResponseOptions", ""),
        (10, "kv", "msg:KVCacheParameters", ""),
        (11, "truncate_prompt_tokens", "uint32", ""),
        (12, "priority", "int32", ""),
        (13, "session_id", "string", "optional"),
        (14, "media", "msg:MediaItem", "repeated"),
        (15, "lora_name", "string", ""),
    ],
    "TokenIds": [(1, "ids", "uint32", "repeated")],
    "RandomSampling": [
        (1, "num_sequences", "uint32", ""),
        (2, "top_k", "uint32", ""),
        (3, "top_p", "float", ""),
        (4, "min_p", "float", ""),
        (5, "seed", "int64", "optional"),
    ],
    "DecodingParameters": [
        (1, "presence_penalty", "float", ""),
        (2, "frequency_penalty", "float", ""),
        (3, "repetition_penalty", "float", ""),
        (4, "logit_bias", "msg:LogitBiasEntry", "map"),
        (5, "allowed_token_ids", "uint32", "repeated"),
        (6, "json", "string", "oneof:structured_output"),
        (7, "regex", "string", "oneof:structured_output"),
        (8, "choice", "msg:StringChoices", "oneof:structured_output"),
        (9, "grammar", "string", "oneof:structured_output"),
        (10, "json_object", "bool", "oneof:structured_output"),
        (11, "structural_tag", "string", "oneof:structured_output"),
    ],
    "DecodingParameters.StringChoices": [(1, "choices", "string", "repeated")],
    "StoppingCriteria": [
        (1, "max_new_tokens", "uint32", ""),
        (2, "min_new_tokens", "uint32", ""),
        (3, "stop_token_ids", "uint32", "repeated"),
        (4, "stop_strings", "string", "repeated"),
        (5, "include_stop_strings", "bool", ""),
        (6, "ignore_eos", "bool", ""),
    ],
    "ResponseOptions": [
        (1, "prompt_token_ids", "bool", ""),
        (2, "prompt_logprobs", "bool", ""),
        (3, "prompt_candidates", "msg:CandidateTokens", "optional"),
        (4, "output_text", "bool", "optional"),
        (5, "output_token_ids", "bool", ""),
        (6, "output_logprobs", "bool", ""),
        (7, "output_candidates", "msg:CandidateTokens", "optional"),
        (8, "skip_special_tokens", "bool", "optional"),
    ],
    "KVCacheParameters": [
        (1, "bypass_prefix_cache", "bool", ""),
        (2, "cache_salt", "string", ""),
        (3, "kv_transfer_params", "msg:Struct", ""),
        (4, "ec_transfer_params", "msg:Struct", ""),
    ],
    "CandidateTokens": [
        (1, "top_n", "uint32", "oneof:select"),
        (2, "token_ids", "msg:TokenIds", "oneof:select"),
        (3, "all", "bool", "oneof:select"),
    ],
    "GenerateResponse": [
        (1, "prompt_info", "msg:PromptInfo", "optional"),
        (2, "outputs", "msg:SequenceOutput", ""),
    ],
    "SequenceOutput": [
        (1, "index", "uint32", ""),
        (2, "text", "string", ""),
        (3, "num_tokens", "uint32", ""),
        (4, "token_ids", "uint32", "repeated"),
        (5, "logprobs", "float", "repeated"),
        (6, "ranks", "uint32", "repeated"),
        (7, "candidate_tokens", "msg:CandidateTokenInfo", "repeated"),
        (8, "finish_info", "msg:FinishInfo", "optional"),
    ],
    "PromptInfo": [
        (1, "num_prompt_tokens", "uint32", ""),
        (2, "token_ids", "uint32", "repeated"),
        (3, "logprobs", "float", "repeated"),
        (4, "ranks", "uint32", "repeated"),
        (5, "candidate_tokens", "msg:CandidateTokenInfo", "repeated"),
    ],
    "FinishInfo": [
        (1, "num_output_tokens", "uint32", ""),
        (2, "finish_reason", "enum:FinishReason", ""),
        (3, "stop_token_id", "uint32", "oneof:stop_reason"),
        (4, "eos_token_id", "uint32", "oneof:stop_reason"),
        (5, "stop_string", "string", "oneof:stop_reason"),
        (6, "kv_transfer_params", "msg:Struct", ""),
        (8, "ec_transfer_params", "msg:Struct", ""),
    ],
    "CandidateTokenInfo": [(1, "tokens", "msg:TokenInfo", "repeated")],
    "CandidateTokenInfo.TokenInfo": [
        (1, "id", "uint32", ""),
        (2, "logprob", "float", ""),
        (3, "rank", "uint32", ""),
    ],
    "MediaItem": [
        (1, "modality", "enum:Modality", ""),
        (2, "url", "string", "oneof:source"),
        (3, "data_uri", "string", "oneof:source"),
        (4, "raw_bytes", "bytes", "oneof:source"),
        (5, "mime_type", "string", ""),
        (6, "uuid", "string", ""),
    ],
}

_EMPTY: list[tuple[int, str, str, str]] = []
CONTROL: dict[str, list[tuple[int, str, str, str]]] = {
    "GetServerInfoRequest": _EMPTY,
    "GetModelInfoRequest": _EMPTY,
    "ServerInfo": [
        (1, "engine_version", "string", ""),
        (2, "api_version", "string", ""),
        (3, "instance_id", "string", ""),
        (4, "parallelism", "msg:ParallelismInfo", ""),
        (5, "max_model_len", "uint32", ""),
        (6, "kv_block_size", "uint32", ""),
        (7, "total_kv_blocks", "uint64", ""),
        (8, "max_running_requests", "uint64", ""),
        (9, "max_batched_tokens", "uint64", ""),
        (10, "max_loras", "uint32", ""),
        (11, "rl_capabilities", "msg:RlCapabilities", ""),
        (14, "effective_attention_block_size", "uint64", "optional"),
    ],
    "RlCapabilities": [
        (1, "weight_transfer_enabled", "bool", ""),
        (2, "weight_transfer_backend", "string", ""),
        (3, "sleep_mode_enabled", "bool", ""),
        (4, "draft_weight_updates_enabled", "bool", ""),
    ],
    "ParallelismInfo": [
        (1, "tensor_parallel_size", "uint32", ""),
        (2, "pipeline_parallel_size", "uint32", ""),
        (3, "data_parallel_size", "uint32", ""),
        (4, "data_parallel_rank", "uint32", ""),
        (5, "decode_context_parallel_size", "uint32", ""),
        (6, "world_size", "uint64", ""),
        (7, "data_parallel_size_local", "uint32", ""),
    ],
    "ModelInfo": [
        (1, "model_id", "string", ""),
        (2, "served_model_name", "string", ""),
        (3, "served_model_aliases", "string", "repeated"),
        (20, "supports_text_input", "bool", ""),
        (21, "supports_token_ids_input", "bool", ""),
        (22, "supports_lora", "bool", ""),
        (23, "supports_multimodal", "bool", ""),
        (24, "reasoning_parser", "string", ""),
        (25, "tool_call_parser", "string", ""),
    ],
    "AbortRequest": [(1, "request_ids", "string", "repeated")],
    "AbortResponse": _EMPTY,
    "GetKvEventSourcesRequest": _EMPTY,
    "GetKvEventSourcesResponse": [(1, "sources", "msg:KvEventSource", "repeated")],
    "KvEventSource": [
        (1, "transport", "string", ""),
        (2, "endpoint", "string", ""),
        (3, "topic", "string", ""),
        (4, "replay_endpoint", "string", ""),
        (5, "data_parallel_rank", "uint32", "optional"),
        (6, "encoding", "string", ""),
        (7, "schema_version", "uint32", ""),
        (8, "buffer_steps", "uint32", ""),
        (9, "hwm", "uint32", ""),
        (10, "max_queue_size", "uint32", ""),
    ],
    "PauseGenerationRequest": [(1, "mode", "enum:PauseMode", ""), (2, "clear_cache", "bool", "optional")],
    "IsPausedResponse": [(1, "paused", "bool", "")],
    "SleepRequest": [(1, "level", "uint32", "optional"), (2, "mode", "enum:PauseMode", "")],
    "WakeUpRequest": [(1, "tags", "string", "repeated")],
    "IsSleepingResponse": [(1, "sleeping", "bool", "")],
    "InitWeightTransferEngineRequest": [(1, "init_info_json", "bytes", "")],
    "UpdateWeightsRequest": [(1, "update_info_json", "bytes", "")],
    "FinishWeightUpdateRequest": [(1, "weight_version", "string", "optional")],
    "UpdateWeightVersionRequest": [(1, "weight_version", "string", "")],
    "GetWeightVersionResponse": [(1, "weight_version", "string", "")],
    "LoraAdapter": [(1, "lora_id", "int64", ""), (2, "lora_name", "string", ""), (3, "source_path", "string", "")],
    "LoadLoraRequest": [(1, "lora_name", "string", ""), (2, "source_path", "string", "")],
    "LoadLoraResponse": [(1, "adapter", "msg:LoraAdapter", "")],
    "UnloadLoraRequest": [(1, "lora_name", "string", "")],
    "UnloadLoraResponse": [(1, "adapter", "msg:LoraAdapter", "")],
    "ListLorasRequest": _EMPTY,
    "ListLorasResponse": [(1, "adapters", "msg:LoraAdapter", "repeated")],
    "ShutdownRequest": _EMPTY,
    "ShutdownResponse": _EMPTY,
}

CONTROL_RPCS = {
    "GetServerInfo": ("GetServerInfoRequest", "ServerInfo"),
    "GetModelInfo": ("GetModelInfoRequest", "ModelInfo"),
    "Abort": ("AbortRequest", "AbortResponse"),
    "GetKvEventSources": ("GetKvEventSourcesRequest", "GetKvEventSourcesResponse"),
    **{
        rpc: (f"{rpc}Request", f"{rpc}Response")
        for rpc in (
            "PauseGeneration ResumeGeneration IsPaused Sleep WakeUp IsSleeping InitWeightTransferEngine "
            "StartWeightUpdate StartDraftWeightUpdate UpdateWeights FinishWeightUpdate UpdateWeightVersion "
            "GetWeightVersion LoadLora UnloadLora ListLoras Shutdown"
        ).split()
    },
}

_SCALARS = {
    _d.FieldDescriptor.TYPE_STRING: "string",
    _d.FieldDescriptor.TYPE_BYTES: "bytes",
    _d.FieldDescriptor.TYPE_BOOL: "bool",
    _d.FieldDescriptor.TYPE_FLOAT: "float",
    _d.FieldDescriptor.TYPE_UINT32: "uint32",
    _d.FieldDescriptor.TYPE_UINT64: "uint64",
    _d.FieldDescriptor.TYPE_INT32: "int32",
    _d.FieldDescriptor.TYPE_INT64: "int64",
}


def _describe(field: _d.FieldDescriptor) -> tuple[int, str, str, str]:
    if field.type == _d.FieldDescriptor.TYPE_MESSAGE:
        type_name = f"msg:{field.message_type.name}"
    elif field.type == _d.FieldDescriptor.TYPE_ENUM:
        type_name = f"enum:{field.enum_type.name}"
    else:
        type_name = _SCALARS[field.type]
    oneof = field.containing_oneof
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        label = "map"
    elif field.is_repeated:
        label = "repeated"
    elif oneof is not None and oneof.name == f"_{field.name}":
        label = "optional"  # proto3 `optional` is a synthetic oneof named after the field
    elif oneof is not None:
        label = f"oneof:{oneof.name}"
    else:
        label = ""
    return field.number, field.name, type_name, label


def _message(module, dotted: str) -> _d.Descriptor:
    descriptor = module.DESCRIPTOR.message_types_by_name[dotted.split(".")[0]]
    for part in dotted.split(".")[1:]:
        descriptor = descriptor.nested_types_by_name[part]
    return descriptor


@pytest.mark.parametrize(
    ("module", "name", "expected"),
    [(inference_pb2, n, f) for n, f in INFERENCE.items()] + [(control_pb2, n, f) for n, f in CONTROL.items()],
    ids=[*INFERENCE, *CONTROL],
)
def test_message_fields_match_the_contract(module, name, expected) -> None:
    actual = sorted(_describe(f) for f in _message(module, name).fields)
    assert actual == sorted(expected)


def test_every_contract_message_is_pinned() -> None:
    def all_names(module) -> set[str]:
        names = set()
        for top in module.DESCRIPTOR.message_types_by_name.values():
            names.add(top.name)
            names.update(f"{top.name}.{n.name}" for n in top.nested_types if not n.GetOptions().map_entry)
        return names

    empty_rl = {f"{rpc}{suffix}" for rpc, (req, resp) in CONTROL_RPCS.items() for suffix in ("Request", "Response")}
    pinned = set(INFERENCE) | set(CONTROL)
    unpinned = (all_names(inference_pb2) | all_names(control_pb2)) - pinned
    # The remaining RL/LoRA request/response messages are declared empty by the contract.
    for name in unpinned:
        assert name in empty_rl, f"{name} is not in the wire-contract table"
        assert not _message(control_pb2, name).fields, f"{name} should have no fields"


def test_services_declare_every_rpc_with_its_types() -> None:
    inference = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    assert {m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in inference.methods} == {
        "Generate": ("GenerateRequest", "GenerateResponse", False),
        "GenerateStream": ("GenerateRequest", "GenerateResponse", True),
    }
    control = control_pb2.DESCRIPTOR.services_by_name["Control"]
    assert {m.name: (m.input_type.name, m.output_type.name) for m in control.methods} == CONTROL_RPCS
    assert not any(m.server_streaming or m.client_streaming for m in control.methods)
    health = health_pb2.DESCRIPTOR.services_by_name["Health"]
    assert {m.name: m.server_streaming for m in health.methods} == {"Check": False, "Watch": True}
    assert {inference.full_name, control.full_name, health.full_name} == {
        "vllm.Inference",
        "vllm.Control",
        "grpc.health.v1.Health",
    }


def test_enums_match_the_contract() -> None:
    finish = inference_pb2.FinishInfo.FinishReason
    assert {finish.Name(v): v for v in finish.values()} == {"NOT_FINISHED": 0, "LENGTH": 1, "STOP": 2, "ABORTED": 3}
    modality = inference_pb2.Modality
    assert {modality.Name(v): v for v in modality.values()} == {
        "MODALITY_UNSPECIFIED": 0,
        "MODALITY_IMAGE": 1,
        "MODALITY_VIDEO": 2,
        "MODALITY_AUDIO": 3,
    }
    pause = control_pb2.PauseMode
    assert {pause.Name(v): v for v in pause.values()} == {
        "PAUSE_MODE_UNSPECIFIED": 0,
        "PAUSE_MODE_ABORT": 1,
        "PAUSE_MODE_WAIT": 2,
        "PAUSE_MODE_KEEP": 3,
    }
    status = health_pb2.HealthCheckResponse.ServingStatus
    assert {status.Name(v): v for v in status.values()} == {
        "UNKNOWN": 0,
        "SERVING": 1,
        "NOT_SERVING": 2,
        "SERVICE_UNKNOWN": 3,
    }


@pytest.mark.parametrize(
    ("message", "first_tag"),
    [
        (inference_pb2.GenerateRequest(lora_name="a"), b"\x7a"),
        (control_pb2.ServerInfo(max_loras=2), b"\x50"),
        (control_pb2.ModelInfo(supports_lora=True), b"\xb0\x01"),
        (inference_pb2.ResponseOptions(skip_special_tokens=True), b"\x40"),
        (control_pb2.ServerInfo(effective_attention_block_size=128), b"\x70"),
    ],
    ids=["lora_name=15", "max_loras=10", "supports_lora=22", "skip_special_tokens=8", "effective_attention=14"],
)
def test_sentinel_fields_encode_to_pinned_tags(message, first_tag: bytes) -> None:
    assert message.SerializeToString().startswith(first_tag)


def test_dp_rank_is_not_a_body_field() -> None:
    # The released protocol carries the rank only as `x-data-parallel-rank` metadata (docs/reference/wire.md#protocol-choice).
    fields = {f.name for f in inference_pb2.GenerateRequest.DESCRIPTOR.fields}
    assert not any("parallel" in name for name in fields)
    assert inference_pb2.GenerateRequest.DESCRIPTOR.fields_by_number[15].type == _d.FieldDescriptor.TYPE_STRING


def test_finish_info_field_7_is_unused() -> None:
    # 7 was a commented-out `seed` upstream; reusing it would misdecode old peers.
    assert 7 not in inference_pb2.FinishInfo.DESCRIPTOR.fields_by_number
