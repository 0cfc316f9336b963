"""Control metadata validation, identity, registration data and component by mode (docs/reference/sidecar.md#component-by-mode, docs/reference/sidecar.md#registration-data)."""

from __future__ import annotations

import pytest

from trio_sidecar._proto.vllm import control_pb2
from trio_sidecar.core.errors import ErrorKind, ProtocolError
from trio_sidecar.core.model import (
    DiscoveredModel,
    EngineConfig,
    ModelIdentity,
    engine_config,
    ensure_startup_compatible,
)


def model_info(**kw: object) -> control_pb2.ModelInfo:
    base = dict(
        model_id="model-source",
        served_model_name="served-model",
        served_model_aliases=["model-alias"],
        supports_text_input=True,
        supports_token_ids_input=True,
        supports_multimodal=False,
        reasoning_parser="deepseek_r1",
        tool_call_parser="hermes",
    )
    base.update(kw)
    return control_pb2.ModelInfo(**base)


def server_info(*, parallelism: bool = True, **kw: object) -> control_pb2.ServerInfo:
    par = dict(
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        data_parallel_size=4,
        data_parallel_rank=0,
        decode_context_parallel_size=1,
    )
    par.update(kw.pop("par", {}))  # type: ignore[arg-type]
    base = dict(
        engine_version="test-vllm",
        api_version="vllm",
        instance_id="test-instance",
        max_model_len=8192,
        kv_block_size=16,
        total_kv_blocks=4096,
        max_running_requests=128,
        max_batched_tokens=2048,
    )
    base.update(kw)
    info = control_pb2.ServerInfo(**base)
    if parallelism:
        info.parallelism.CopyFrom(control_pb2.ParallelismInfo(**par))
    return info


def test_reference_fixture_registration_data() -> None:
    model = DiscoveredModel.from_proto(model_info(), server_info())
    assert model.identity == ModelIdentity(
        model_id="model-source",
        served_model_name="served-model",
        served_model_aliases=("model-alias",),
        reasoning_parser="deepseek_r1",
        tool_call_parser="hermes",
    )
    assert model.data_parallel_size() == 4
    assert model.supports_multimodal is False
    assert engine_config(model) == EngineConfig(
        model="model-source",
        served_model_name="served-model",
        aliases=("model-alias",),
        context_length=8192,
        kv_cache_block_size=16,
        total_kv_blocks=1024,  # per rank: vLLM reports the sum of its 4 ranks
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        data_parallel_size=4,
        data_parallel_start_rank=0,
    )
    cfg = engine_config(model)
    assert cfg.tool_call_parser is None and cfg.reasoning_parser is None  # never advertised


def test_zero_limits_become_none_and_no_parallelism() -> None:
    info = server_info(
        parallelism=False, max_model_len=0, kv_block_size=0, total_kv_blocks=0, max_running_requests=0,
        max_batched_tokens=0,
    )  # fmt: skip
    model = DiscoveredModel.from_proto(model_info(), info)
    cfg = engine_config(model)
    assert (
        cfg.context_length,
        cfg.kv_cache_block_size,
        cfg.total_kv_blocks,
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        cfg.data_parallel_size,
        cfg.data_parallel_start_rank,
    ) == (None,) * 7
    assert model.data_parallel_size() == 1


def test_partial_zero_limits() -> None:
    cfg = engine_config(DiscoveredModel.from_proto(model_info(), server_info(total_kv_blocks=0, max_model_len=7)))
    assert cfg.total_kv_blocks is None and cfg.context_length == 7 and cfg.max_num_seqs == 128


@pytest.mark.parametrize(
    ("mi", "si", "message"),
    [
        ({}, dict(api_version="sglang"), "unsupported Control API version `sglang`; expected `vllm`"),
        ({}, dict(api_version=""), "unsupported Control API version ``; expected `vllm`"),
        (dict(model_id="  "), {}, "Control returned an empty model_id"),
        (dict(served_model_name=""), {}, "Control returned an empty served_model_name"),
        (dict(supports_token_ids_input=False), {}, "the discovered model does not support token-ID input"),
        ({}, dict(par=dict(data_parallel_size=0)), "vLLM reports a data-parallel size of zero"),
        (
            {},
            dict(par=dict(data_parallel_rank=2)),
            "vLLM reports data_parallel_rank 2 without data_parallel_size_local; hybrid rank ownership requires "
            "the local-size Control field",
        ),
        (
            {},
            dict(par=dict(data_parallel_rank=2, data_parallel_size_local=3)),
            "vLLM reports an invalid local data-parallel range: start 2, local size 3, global size 4",
        ),
        (
            {},
            dict(effective_attention_block_size=0),
            "invalid effective_attention_block_size 0; KV routing requires a nonzero size that fits u32",
        ),
    ],
)
def test_discovery_rejections(mi: dict, si: dict, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        engine_config(DiscoveredModel.from_proto(model_info(**mi), server_info(**si)))
    assert str(info.value) == "invalid vLLM gRPC response: " + message
    assert info.value.kind is ErrorKind.UNKNOWN


def test_validation_order() -> None:
    # Every check fails; the api_version one is reported first, then model_id, ...
    with pytest.raises(ProtocolError, match="API version"):
        DiscoveredModel.from_proto(
            model_info(model_id="", served_model_name="", supports_token_ids_input=False),
            server_info(api_version="x", par=dict(data_parallel_size=0)),
        )
    with pytest.raises(ProtocolError, match="empty model_id"):
        DiscoveredModel.from_proto(model_info(model_id="", served_model_name=""), server_info())
    with pytest.raises(ProtocolError, match="token-ID input"):
        DiscoveredModel.from_proto(
            model_info(supports_token_ids_input=False), server_info(par=dict(data_parallel_size=0))
        )


@pytest.mark.parametrize("local", [0, 4])
def test_local_size_zero_or_full_is_accepted(local: int) -> None:
    assert DiscoveredModel.from_proto(model_info(), server_info(par=dict(data_parallel_size_local=local)))


def test_original_strings_and_blank_parsers() -> None:
    model = DiscoveredModel.from_proto(
        model_info(model_id=" m ", served_model_name=" s", reasoning_parser="  ", tool_call_parser=""),
        server_info(),
    )
    assert model.identity.model_id == " m " and model.served_model_name == " s"
    assert model.identity.reasoning_parser is None and model.identity.tool_call_parser is None


def test_discovered_model_copies_the_messages() -> None:
    info = server_info()
    model = DiscoveredModel.from_proto(model_info(), info)
    info.max_model_len = 1
    assert model.server_info.max_model_len == 8192


def boot(**mi: object) -> DiscoveredModel:
    return DiscoveredModel.from_proto(model_info(**mi), server_info())


def test_startup_compatible_allows_other_server_changes() -> None:
    observed = DiscoveredModel.from_proto(model_info(), server_info(instance_id="other", max_model_len=4))
    ensure_startup_compatible(boot(), observed)


@pytest.mark.parametrize(
    "change",
    [
        dict(served_model_name="renamed"),
        dict(model_id="other-source"),
        dict(served_model_aliases=["b", "a"]),
        dict(reasoning_parser="other"),
        dict(tool_call_parser=""),
    ],
)
def test_identity_change_is_fatal(change: dict) -> None:
    bootstrap = DiscoveredModel.from_proto(model_info(served_model_aliases=["a", "b"]), server_info())
    observed = DiscoveredModel.from_proto(model_info(**{"served_model_aliases": ["a", "b"], **change}), server_info())
    with pytest.raises(ProtocolError) as info:
        ensure_startup_compatible(bootstrap, observed)
    text = str(info.value)
    assert text.startswith("invalid vLLM gRPC response: model identity changed between bootstrap and startup: ")
    assert f"expected {bootstrap.identity!r}, observed {observed.identity!r}" in text


def test_parallelism_change_is_fatal() -> None:
    observed = DiscoveredModel.from_proto(model_info(), server_info(par=dict(data_parallel_size=2)))
    with pytest.raises(ProtocolError) as info:
        ensure_startup_compatible(boot(), observed)
    text = str(info.value)
    assert text.startswith("invalid vLLM gRPC response: parallelism changed between bootstrap and startup: expected ")
    assert "data_parallel_size: 4" in text and "data_parallel_size: 2" in text
    no_par = DiscoveredModel.from_proto(model_info(), server_info(parallelism=False))
    with pytest.raises(ProtocolError, match="parallelism changed .* observed None"):
        ensure_startup_compatible(boot(), no_par)


def test_rl_capabilities_change_is_fatal() -> None:
    observed = server_info()
    observed.rl_capabilities.sleep_mode_enabled = True
    with pytest.raises(ProtocolError, match="^invalid vLLM gRPC response: RL capabilities changed between bootstrap"):
        ensure_startup_compatible(boot(), DiscoveredModel.from_proto(model_info(), observed))


@pytest.mark.parametrize(
    ("mi", "si"), [(dict(supports_lora=True), {}), ({}, dict(max_loras=3)), (dict(supports_multimodal=True), {})]
)
def test_lora_and_multimodal_support_are_part_of_the_identity(mi: dict, si: dict) -> None:
    observed = DiscoveredModel.from_proto(model_info(**mi), server_info(**si))
    with pytest.raises(ProtocolError, match="model identity changed between bootstrap and startup"):
        ensure_startup_compatible(boot(), observed)


@pytest.mark.parametrize(
    ("par", "ranks", "dp_size", "start"),
    [
        (dict(data_parallel_size=4, data_parallel_size_local=4), range(0, 4), 4, 0),
        (dict(data_parallel_size=4, data_parallel_rank=2, data_parallel_size_local=2), range(2, 4), 2, 2),
        (dict(data_parallel_size=4, data_parallel_size_local=0), range(0, 4), 4, 0),
    ],
)
def test_hosted_ranks_set_the_registered_dp_size_start_and_per_rank_capacity(par, ranks, dp_size, start) -> None:
    model = DiscoveredModel.from_proto(model_info(), server_info(par=par, total_kv_blocks=4097))
    assert model.local_ranks == ranks
    cfg = engine_config(model)
    assert (cfg.data_parallel_size, cfg.data_parallel_start_rank) == (dp_size, start)
    assert cfg.total_kv_blocks == 4097 // dp_size  # the floor, as native


def test_the_effective_attention_block_size_wins_over_the_kv_block_size() -> None:
    assert engine_config(DiscoveredModel.from_proto(model_info(), server_info())).kv_cache_block_size == 16
    with_effective = server_info()
    with_effective.effective_attention_block_size = 32
    assert engine_config(DiscoveredModel.from_proto(model_info(), with_effective)).kv_cache_block_size == 32
