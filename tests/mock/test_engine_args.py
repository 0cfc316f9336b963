"""Engine arguments (docs/reference/mock.md#engine-arguments, docs/reference/mock.md#startup-validation; docs/reference/mock.md#multimodal, docs/reference/mock.md#token-seed-and-request-uuid, docs/reference/mock.md#scheduler) — pure, table-driven."""

from __future__ import annotations

import json

import pytest

from trio_sidecar.mock.engine_args import (
    EngineArgs,
    EngineArgsError,
    PreemptionMode,
    TokenSeedSource,
    engine_args_from_mapping,
    parse_engine_args,
    validate_engine_args,
)


def test_defaults_when_absent():
    args = parse_engine_args(None)
    assert args == EngineArgs()
    assert (args.engine_type, args.block_size, args.num_gpu_blocks) == ("vllm", 64, 16384)
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (256, 8192)
    assert args.enable_prefix_caching and args.enable_chunked_prefill
    assert (args.speedup_ratio, args.decode_speedup_ratio, args.dp_size) == (1.0, 1.0, 1)
    assert args.max_model_len is None and args.startup_time is None
    assert args.preemption_mode is PreemptionMode.LIFO
    assert args.zmq_kv_events_port is None and args.zmq_replay_port is None
    assert args.token_seed_source is TokenSeedSource.REQUEST_ID
    assert (args.image_token_id, args.tokens_per_image) == (31999, 16)
    assert parse_engine_args("{}") == EngineArgs()
    validate_engine_args(args)


def test_inline_json_values_are_applied():
    args = parse_engine_args(
        '  \n {"speedup_ratio": 1000, "block_size": 4, "num_gpu_blocks": 10, "max_num_seqs": null,'
        ' "max_num_batched_tokens": null, "enable_prefix_caching": false, "dp_size": 2,'
        ' "preemption_mode": "Fifo", "engine_type": "VLLM", "max_model_len": 8,'
        ' "token_seed_source": "prompt", "image_token_id": 7, "tokens_per_image": 3,'
        ' "zmq_kv_events_port": 5557, "zmq_replay_port": 5600, "startup_time": 2}'
    )
    assert args.speedup_ratio == 1000.0 and isinstance(args.speedup_ratio, float)
    assert (args.block_size, args.num_gpu_blocks, args.dp_size, args.max_model_len) == (4, 10, 2, 8)
    assert args.max_num_seqs is None and args.seq_limit is None
    assert args.max_num_batched_tokens is None and args.token_budget is None
    assert args.enable_prefix_caching is False
    assert args.preemption_mode is PreemptionMode.FIFO
    assert args.engine_type == "vllm"
    assert args.token_seed_source is TokenSeedSource.PROMPT
    assert (args.image_token_id, args.tokens_per_image) == (7, 3)
    assert (args.zmq_kv_events_port, args.zmq_replay_port, args.startup_time) == (5557, 5600, 2.0)
    validate_engine_args(args)


def test_block_size_zero_means_64():
    assert parse_engine_args('{"block_size": 0}').block_size == 64


def test_zero_limits_mean_unlimited():
    args = parse_engine_args('{"max_num_seqs": 0, "max_num_batched_tokens": 0}')
    assert args.seq_limit is None and args.token_budget is None


def test_file_path_is_read(tmp_path):
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"speedup_ratio": 0.0, "block_size": 16}))
    args = parse_engine_args(str(path))
    assert (args.speedup_ratio, args.block_size) == (0.0, 16)


def test_missing_file_is_an_error(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(EngineArgsError, match="cannot read engine args file") as info:
        parse_engine_args(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "suggestion"),
    [('{"speedup_ration": 1}', "did you mean 'speedup_ratio'?"), ('{"dp_szie": 2}', "did you mean 'dp_size'?")],
)
def test_an_unknown_key_suggests_the_closest_and_lists_the_valid_keys(text, suggestion):
    with pytest.raises(EngineArgsError) as info:
        parse_engine_args(text)
    message = str(info.value)
    assert message.startswith("unknown engine arg '") and suggestion in message
    assert "(valid keys: engine_type, block_size, " in message and "tool_call_parser)" in message
    assert "planner_profile_data" not in message  # accepted but ignored keys are not advertised


def test_an_unknown_key_far_from_every_valid_key_gets_no_suggestion():
    with pytest.raises(EngineArgsError) as info:
        parse_engine_args('{"bogus": 1}')
    assert str(info.value).startswith("unknown engine arg 'bogus' (valid keys: ")


@pytest.mark.parametrize(("text", "kind"), [("[1,2]", "array"), ('"x"', "string"), ("3", "number")])
def test_inline_json_that_is_not_an_object_says_so(text, kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file of that name exists
    with pytest.raises(EngineArgsError) as info:
        parse_engine_args(text)
    assert str(info.value) == (
        f"engine args must be a JSON object such as '{{\"speedup_ratio\": 0}}', not a JSON {kind}"
    )


def test_ignored_keys_are_accepted():
    args = parse_engine_args(
        '{"planner_profile_data": "/x", "reasoning": {"a": 1}, "kv_bytes_per_token": null,'
        ' "kv_transfer_bandwidth": 1.5}'
    )
    assert args == EngineArgs()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"block_size": null}', "engine arg 'block_size' must not be null"),
        ('{"enable_prefix_caching": null}', "engine arg 'enable_prefix_caching' must not be null"),
        ('{"speedup_ratio": null}', "engine arg 'speedup_ratio' must not be null"),
        ('{"preemption_mode": null}', "engine arg 'preemption_mode' must not be null"),
        ('{"block_size": "4"}', "engine arg 'block_size' must be an integer"),
        ('{"block_size": 4.0}', "engine arg 'block_size' must be an integer"),
        ('{"block_size": true}', "engine arg 'block_size' must be an integer"),
        ('{"num_gpu_blocks": -1}', "engine arg 'num_gpu_blocks' must not be negative"),
        ('{"enable_chunked_prefill": 1}', "engine arg 'enable_chunked_prefill' must be a boolean"),
        ('{"speedup_ratio": "fast"}', "engine arg 'speedup_ratio' must be a number"),
        ('{"speedup_ratio": NaN}', "invalid engine args JSON: NaN is not a valid JSON number"),
        ('{"preemption_mode": "random"}', "engine arg 'preemption_mode' must be one of: lifo, fifo"),
        ('{"token_seed_source": "seed"}', "engine arg 'token_seed_source' must be one of: request_id, prompt"),
        ('{"engine_type": 3}', "engine arg 'engine_type' must be a string"),
        ('{"block_size": 4, "block_size": 8}', "duplicate engine arg 'block_size'"),
    ],
)
def test_shape_errors(text, message):
    with pytest.raises(EngineArgsError) as info:
        parse_engine_args(text)
    assert str(info.value) == message
    assert info.value.message == message


@pytest.mark.parametrize("content", ["[1, 2]", '"{"', "null", "42"])
def test_top_level_must_be_an_object(tmp_path, content):
    # Inline JSON starts with "{" (docs/reference/mock.md#cli), so other top levels arrive through a file.
    path = tmp_path / "engine.json"
    path.write_text(content)
    with pytest.raises(EngineArgsError) as info:
        parse_engine_args(str(path))
    assert str(info.value).startswith("engine args must be a JSON object such as ")


def test_trailing_data_is_an_error():
    with pytest.raises(EngineArgsError, match="trailing data"):
        parse_engine_args('{"block_size": 4} {"x": 1}')
    with pytest.raises(EngineArgsError, match="trailing data"):
        parse_engine_args('{"block_size": 4}]')


def test_syntax_error_is_an_error():
    with pytest.raises(EngineArgsError, match=r"^invalid engine args JSON: .* at line 1 column"):
        parse_engine_args('{"block_size": }')


def test_mapping_form_uses_the_same_rules():
    assert engine_args_from_mapping({"speedup_ratio": 0, "block_size": 4}).block_size == 4
    with pytest.raises(EngineArgsError, match="^unknown engine arg 'nope' "):
        engine_args_from_mapping({"nope": 1})
    with pytest.raises(EngineArgsError, match="must be a JSON object"):
        engine_args_from_mapping([("block_size", 4)])  # type: ignore[arg-type]


# --- startup validation (docs/reference/mock.md#startup-validation) -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "mcr", "message", "key"),
    [
        ({"engine_type": "sglang"}, 256, "engine arg 'engine_type' must be \"vllm\"", "engine_type"),
        ({"dp_size": 0}, 256, "engine arg 'dp_size' must be at least 1", "dp_size"),
        (
            {},
            0,
            "max_concurrent_requests (--max-concurrent-requests) must be greater than 0",
            "max_concurrent_requests",
        ),
        (
            {"worker_type": "prefill"},
            256,
            "engine arg 'worker_type' must be \"aggregated\" (is_prefill and is_decode must be false); use "
            "--disaggregation-mode for the emulated wire role",
            "worker_type",
        ),
        ({"is_prefill": True}, 256, "engine arg 'worker_type' must be \"aggregated\"", "worker_type"),
        ({"is_decode": True}, 256, "engine arg 'worker_type' must be \"aggregated\"", "worker_type"),
        ({"num_gpu_blocks": 0}, 256, "engine arg 'num_gpu_blocks' must be greater than 0", "num_gpu_blocks"),
        ({"max_model_len": 2**32}, 256, "engine arg 'max_model_len' must be at most 4294967295", "max_model_len"),
        ({"block_size": 2**32}, 256, "engine arg 'block_size' must be at most 4294967295", "block_size"),
        (
            {"num_gpu_blocks": 2**63, "dp_size": 2},
            256,
            "engine arg 'num_gpu_blocks' must be at most 18446744073709551615",
            "num_gpu_blocks",
        ),
        (
            {"max_num_seqs": 2**64},
            256,
            "engine arg 'max_num_seqs' must be at most 18446744073709551615",
            "max_num_seqs",
        ),
        (
            {"max_num_batched_tokens": 2**64},
            256,
            "engine arg 'max_num_batched_tokens' must be at most 18446744073709551615",
            "max_num_batched_tokens",
        ),
        ({"speedup_ratio": -1}, 256, "engine arg 'speedup_ratio' must not be negative", "speedup_ratio"),
        (
            {"decode_speedup_ratio": 0},
            256,
            "engine arg 'decode_speedup_ratio' must be greater than 0",
            "decode_speedup_ratio",
        ),
        (
            {"zmq_kv_events_port": 65535, "dp_size": 2},
            256,
            "engine arg 'zmq_kv_events_port' must leave a port",
            "zmq_kv_events_port",
        ),
        ({"tokens_per_image": 0}, 256, "engine arg 'tokens_per_image' must be greater than 0", "tokens_per_image"),
    ],
)
def test_startup_validation_messages_name_the_key(engine, mcr, message, key):
    args = engine_args_from_mapping(engine)
    with pytest.raises(EngineArgsError) as info:
        validate_engine_args(args, max_concurrent_requests=mcr)
    assert str(info.value).startswith(message)
    assert key in str(info.value)


@pytest.mark.parametrize(
    ("engine", "mcr", "first"),
    [
        # Every check fails: the documented order (docs/reference/mock.md#startup-validation) decides which message wins.
        ({"engine_type": "x", "dp_size": 0, "worker_type": "decode", "num_gpu_blocks": 0}, 0, "engine_type"),
        ({"dp_size": 0, "worker_type": "decode", "num_gpu_blocks": 0}, 0, "dp_size"),
        ({"worker_type": "decode", "num_gpu_blocks": 0}, 0, "max_concurrent_requests"),
        ({"worker_type": "decode", "num_gpu_blocks": 0}, 1, "worker_type"),
        ({"num_gpu_blocks": 0, "max_model_len": 2**40}, 1, "num_gpu_blocks"),
        ({"max_model_len": 2**40, "block_size": 2**40}, 1, "max_model_len"),
    ],
)
def test_startup_validation_order(engine, mcr, first):
    with pytest.raises(EngineArgsError) as info:
        validate_engine_args(engine_args_from_mapping(engine), max_concurrent_requests=mcr)
    assert first in str(info.value)
    # The first failing key is named before any later key.
    later = {"dp_size", "worker_type", "num_gpu_blocks", "max_model_len", "block_size"} - {first}
    assert not any(k in str(info.value) for k in later)


def test_case_insensitive_enums_reach_validation():
    validate_engine_args(parse_engine_args('{"engine_type": "Vllm", "worker_type": "AGGREGATED"}'))
