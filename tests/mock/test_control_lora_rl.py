"""The mock's LoRA and RL Control RPCs (docs/reference/mock.md#lora-adapters, docs/reference/mock.md#rl-controls):
the pure state machines, then the RPCs through our client and through grpcio, with vLLM 0.32's texts and codes.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import trio
from mock_helpers import FinishReason, collect, control, gen, running_mock

from trio_sidecar._proto.vllm import control_pb2 as c
from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode as C
from trio_sidecar.mock import engine_args as ea
from trio_sidecar.mock.generation import RequestRejected
from trio_sidecar.mock.lora import LoraTable
from trio_sidecar.mock.rl import PauseMode, PauseState, RlCapabilities, RlState
from trio_sidecar.transport import RpcError

LORA_DISABLED = (C.FAILED_PRECONDITION, "engine was not started with LoRA enabled")
SLEEP_OFF = (C.FAILED_PRECONDITION, "sleep mode is not configured; start vLLM with --enable-sleep-mode")
TRANSFER_OFF = (C.FAILED_PRECONDITION, "weight transfer is not configured; start vLLM with --weight-transfer-config")
RL_ON = {"enable_sleep_mode": True, "weight_transfer_backend": "nccl", "enable_draft_weight_updates": True}


def rejected(fn, *args, **kw) -> tuple[C, str]:
    with pytest.raises(RequestRejected) as info:
        fn(*args, **kw)
    return info.value.code, info.value.message


async def rpc(ch, name: str, **fields):
    request = getattr(c, f"{name}Request")(**fields)
    return await control(ch, name, request, getattr(c, f"{name}Response"))


async def rpc_status(ch, name: str, **fields) -> tuple[C, str]:
    with pytest.raises(RpcError) as info:
        await rpc(ch, name, **fields)
    return info.value.code, info.value.message


def test_lora_and_rl_modules_are_pure():
    code = "import sys\nimport trio_sidecar.mock.lora, trio_sidecar.mock.rl\nassert 'trio' not in sys.modules, 'trio imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- pure: the adapter table ---------------------------------------------------------------------------


def test_lora_table_loads_in_order_with_increasing_ids_and_unloads():
    table = LoraTable(2, ("base",))
    a = table.load("a", "/adapters/a")
    b = table.load("b", "/adapters/b")
    assert [(x.lora_id, x.lora_name, x.source_path) for x in table.list()] == [
        (1, "a", "/adapters/a"),
        (2, "b", "/adapters/b"),
    ]
    assert table.unload("a") == a and "a" not in table and b in table.list()
    assert table.load("c", "/adapters/c").lora_id == 3  # ids are never reused


def test_lora_table_errors_use_vllms_texts_in_vllms_order():
    table = LoraTable(1, ("base",))
    assert rejected(table.load, "", "") == (C.INVALID_ARGUMENT, "lora_name must not be empty")
    assert rejected(table.load, "a", "") == (C.INVALID_ARGUMENT, "lora_path must not be empty")
    assert rejected(table.load, "base", "/p") == (
        C.ALREADY_EXISTS,
        "LoRA adapter `base` conflicts with a served base model",
    )
    table.load("a", "/p")
    assert rejected(table.load, "a", "/p") == (C.ALREADY_EXISTS, "LoRA adapter `a` is already loaded")
    assert rejected(table.unload, "") == (C.INVALID_ARGUMENT, "lora_name is required")
    assert rejected(table.unload, "b") == (C.NOT_FOUND, "LoRA adapter `b` is not loaded")
    assert rejected(table.check_request, "b") == (C.NOT_FOUND, "LoRA adapter `b` is not loaded")
    table.check_request("a")
    # max_loras (1) bounds the adapters of one batch, not the table: vLLM loads more (it evicts and reloads).
    assert table.load("b", "/p").lora_id == 2 and [a.lora_name for a in table.list()] == ["a", "b"]


def test_lora_table_evicts_the_least_recently_used_adapter_and_cannot_unload_it_until_used():
    """As vLLM 0.32's engine cache (capacity max_loras): eviction keeps the adapter listed and usable."""
    table = LoraTable(2, ())
    a, b, c = (table.load(name, f"/adapters/{name}") for name in "abc")
    assert table.resident == ("b", "c") and table.list() == [a, b, c]
    assert rejected(table.unload, "a") == (C.INTERNAL, "engine rejected removal of LoRA adapter `a` with id 1")
    assert table.list() == [a, b, c]
    table.check_request("a")  # an evicted adapter still serves requests
    assert table.resident == ("b", "c")  # checking is not using
    table.use("a")
    assert table.resident == ("c", "a")
    assert table.unload("a") == a and table.resident == ("c",)
    assert rejected(table.unload, "b") == (C.INTERNAL, "engine rejected removal of LoRA adapter `b` with id 2")
    table.use("c")
    table.use("b")
    assert table.resident == ("c", "b")
    assert table.unload("b") == b and table.unload("c") == c and table.list() == [] and table.resident == ()


def test_disabled_lora_table_refuses_everything_but_checks_an_empty_unload_name_first():
    table = LoraTable(0, ())
    for call in (
        lambda: table.load("a", "/p"),
        lambda: table.load("", ""),
        table.list,
        lambda: table.unload("a"),
        lambda: table.check_request("a"),
    ):
        assert rejected(call) == LORA_DISABLED
    assert rejected(table.unload, "") == (C.INVALID_ARGUMENT, "lora_name is required")


# --- pure: pause, sleep, weights -----------------------------------------------------------------------


def test_pause_resume_state_machine_and_is_sleeping_follows_a_pause():
    state = RlState(RlCapabilities())
    assert not state.paused and not state.sleeping
    state.resume()  # not paused: a no-op
    assert state.pause(PauseMode.from_proto(c.PAUSE_MODE_UNSPECIFIED)) is PauseMode.ABORT
    assert state.pause_state is PauseState.PAUSED_NEW and state.paused and state.sleeping
    state.pause(PauseMode.from_proto(c.PAUSE_MODE_KEEP))
    assert state.pause_state is PauseState.PAUSED_ALL
    state.resume()
    assert not state.paused and not state.sleeping


def test_sleep_levels_and_wake_up_tags():
    state = RlState(RlCapabilities(sleep_mode_enabled=True))
    state.sleep(0, PauseMode.ABORT)
    assert state.paused and state.sleeping_tags == frozenset()
    assert state.wake_up(["scheduling"]) and not state.sleeping
    state.sleep(None, PauseMode.KEEP)  # unset level = 1
    assert state.sleep_level == 1 and state.sleeping_tags == {"weights", "kv_cache"}
    assert not state.wake_up(["bogus"]) and state.sleeping_tags == {"weights", "kv_cache"}  # vLLM: ignored
    assert not state.wake_up(["weights"]) and state.sleeping_tags == {"kv_cache"} and state.paused
    assert state.wake_up(["kv_cache", "scheduling"]) and not state.sleeping
    state.sleep(2, PauseMode.ABORT)
    assert state.sleep_level == 2 and state.wake_up([]) and not state.sleeping
    assert rejected(state.sleep, 3, PauseMode.ABORT) == (C.INVALID_ARGUMENT, "sleep level must be 0, 1 or 2, got 3")


def test_sleep_and_wake_up_need_sleep_mode():
    state = RlState(RlCapabilities())
    assert rejected(state.sleep, 1, PauseMode.ABORT) == SLEEP_OFF
    assert rejected(state.wake_up, []) == SLEEP_OFF
    assert not state.paused


def test_weight_update_state_machine():
    state = RlState(RlCapabilities(weight_transfer_backend="nccl"))
    assert state.weight_version == "default"
    assert rejected(state.start_weight_update) == (
        C.FAILED_PRECONDITION,
        "the weight transfer engine is not initialized",
    )
    assert rejected(state.init_weight_transfer, b"not json") == (
        C.INVALID_ARGUMENT,
        "init_info_json must be a JSON object",
    )
    state.init_weight_transfer(b'{"master_port": 1}')
    assert rejected(state.update_weights, b"{}") == (C.FAILED_PRECONDITION, "no weight update is in progress")
    state.start_weight_update()
    assert rejected(state.start_weight_update) == (C.FAILED_PRECONDITION, "a weight update is already in progress")
    state.update_weights(b'{"names": []}')
    state.update_weights(b'{"names": []}')
    assert state.weight_update == "target" and state.weight_update_chunks == 2
    assert rejected(state.finish_weight_update, "") == (C.INVALID_ARGUMENT, "weight_version must not be empty")
    state.finish_weight_update("step-1")
    assert state.weight_update is None and state.weight_version == "step-1"
    assert rejected(state.start_weight_update, draft=True) == (
        C.FAILED_PRECONDITION,
        "draft weight updates are not enabled",
    )
    assert rejected(state.set_weight_version, "") == (C.INVALID_ARGUMENT, "weight_version must not be empty")


def test_weight_transfer_rpcs_need_a_backend_but_the_version_does_not():
    state = RlState(RlCapabilities())
    for call in (
        lambda: state.init_weight_transfer(b"{}"),
        state.start_weight_update,
        lambda: state.start_weight_update(draft=True),
        lambda: state.update_weights(b"{}"),
        lambda: state.finish_weight_update("v"),
    ):
        assert rejected(call) == TRANSFER_OFF
    state.set_weight_version("v7")
    assert state.weight_version == "v7"


def test_engine_args_for_lora_and_rl():
    args = ea.engine_args_from_mapping({"max_loras": 2, **RL_ON})
    assert (args.max_loras, args.enable_sleep_mode, args.weight_transfer_backend) == (2, True, "nccl")
    with pytest.raises(
        ea.EngineArgsError, match="engine arg 'enable_draft_weight_updates' requires weight_transfer_backend"
    ):
        ea.validate_engine_args(ea.engine_args_from_mapping({"enable_draft_weight_updates": True}))
    with pytest.raises(ea.EngineArgsError, match="'max_loras' must be an integer"):
        ea.engine_args_from_mapping({"max_loras": "2"})


# --- the RPCs on a running mock ------------------------------------------------------------------------


async def test_server_and_model_info_advertise_lora_and_rl_capabilities():
    async with running_mock(served_model_name="tiny", engine_args={"max_loras": 3, **RL_ON}) as (_, ch):
        info = await control(ch, "GetServerInfo", c.GetServerInfoRequest(), c.ServerInfo)
        model = await control(ch, "GetModelInfo", c.GetModelInfoRequest(), c.ModelInfo)
    assert info.max_loras == 3 and model.supports_lora
    assert info.rl_capabilities == c.RlCapabilities(
        weight_transfer_enabled=True,
        weight_transfer_backend="nccl",
        sleep_mode_enabled=True,
        draft_weight_updates_enabled=True,
    )


async def test_a_request_brings_an_evicted_adapter_back_so_that_it_can_be_unloaded():
    """vLLM 0.32 with --max-loras 2 and three adapters (docs/reference/mock.md#lora-adapters)."""
    async with running_mock(served_model_name="tiny", engine_args={"max_loras": 2}) as (mock, ch):
        for name in "abc":
            await rpc(ch, "LoadLora", lora_name=name, source_path=f"/adapters/{name}")
        evicted = (C.INTERNAL, "engine rejected removal of LoRA adapter `a` with id 1")
        assert await rpc_status(ch, "UnloadLora", lora_name="a") == evicted
        assert [a.lora_name for a in (await rpc(ch, "ListLoras")).adapters] == ["a", "b", "c"]
        messages = await collect(ch, gen("with-a", max_new_tokens=2, lora_name="a"))
        assert messages[-1].outputs.finish_info.finish_reason == FinishReason.LENGTH
        assert mock.lora.resident == ("c", "a")
        assert (await rpc(ch, "UnloadLora", lora_name="a")).adapter.lora_id == 1


async def test_lora_lifecycle_and_generate_with_the_adapter_are_recorded():
    async with running_mock(served_model_name="tiny", engine_args={"max_loras": 2}) as (mock, ch):
        loaded = await rpc(ch, "LoadLora", lora_name="a", source_path="/adapters/a")
        assert (loaded.adapter.lora_id, loaded.adapter.lora_name, loaded.adapter.source_path) == (1, "a", "/adapters/a")
        messages = await collect(ch, gen("with-a", max_new_tokens=3, lora_name="a"))
        assert messages[-1].outputs.finish_info.finish_reason == FinishReason.LENGTH
        assert [a.lora_name for a in (await rpc(ch, "ListLoras")).adapters] == ["a"]
        assert await rpc_status(ch, "LoadLora", lora_name="tiny", source_path="/p") == (
            C.ALREADY_EXISTS,
            "LoRA adapter `tiny` conflicts with a served base model",
        )
        unloaded = await rpc(ch, "UnloadLora", lora_name="a")
        assert unloaded.adapter.lora_id == 1
        with pytest.raises(RpcError) as info:
            await collect(ch, gen("after-unload", max_new_tokens=3, lora_name="a"))
        assert (info.value.code, info.value.message) == (C.NOT_FOUND, "LoRA adapter `a` is not loaded")
        assert await rpc_status(ch, "UnloadLora", lora_name="a") == (C.NOT_FOUND, "LoRA adapter `a` is not loaded")
        assert list((await rpc(ch, "ListLoras")).adapters) == []
        calls = [(name, getattr(req, "lora_name", None)) for name, req in mock.control_calls]
        assert calls == [
            ("LoadLora", "a"),
            ("ListLoras", None),
            ("LoadLora", "tiny"),
            ("UnloadLora", "a"),
            ("UnloadLora", "a"),
            ("ListLoras", None),
        ]
        assert [r.lora_name for _, r, _, _ in mock.recorded_requests] == ["a", "a"]


async def test_without_lora_every_lora_rpc_and_lora_name_fail_as_vllm():
    async with running_mock() as (mock, ch):
        assert await rpc_status(ch, "LoadLora", lora_name="a", source_path="/p") == LORA_DISABLED
        assert await rpc_status(ch, "ListLoras") == LORA_DISABLED
        assert await rpc_status(ch, "UnloadLora", lora_name="a") == LORA_DISABLED
        assert await rpc_status(ch, "UnloadLora") == (C.INVALID_ARGUMENT, "lora_name is required")
        with pytest.raises(RpcError) as info:
            await collect(ch, gen("x", lora_name="a"))
        assert (info.value.code, info.value.message) == LORA_DISABLED
        assert [name for name, _ in mock.control_calls] == ["LoadLora", "ListLoras", "UnloadLora", "UnloadLora"]


async def test_pause_abort_ends_in_flight_requests_and_is_paused_reports_it():
    async with running_mock(engine_args={"speedup_ratio": 1.0}) as (mock, ch):
        messages: list = []

        async def stream():
            messages.extend(await collect(ch, gen("long", max_new_tokens=5000)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            with trio.fail_after(10):
                await mock.metrics_value().wait_value(lambda m: m.running_requests == 1)
            await rpc(ch, "PauseGeneration")
        assert messages[-1].outputs.finish_info.finish_reason == FinishReason.ABORTED
        assert (await rpc(ch, "IsPaused")).paused and (await rpc(ch, "IsSleeping")).sleeping
        await rpc(ch, "ResumeGeneration")
        assert not (await rpc(ch, "IsPaused")).paused
        assert [name for name, _ in mock.control_calls] == [
            "PauseGeneration",
            "IsPaused",
            "IsSleeping",
            "ResumeGeneration",
            "IsPaused",
        ]


async def test_pause_wait_returns_after_in_flight_requests_finish():
    async with running_mock(engine_args={"speedup_ratio": 1.0}) as (mock, ch):
        messages: list = []

        async def stream():
            messages.extend(await collect(ch, gen("drain", max_new_tokens=40)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            with trio.fail_after(10):
                await mock.metrics_value().wait_value(lambda m: m.running_requests == 1)
                assert mock.call_record("drain").ended is None
                await rpc(ch, "PauseGeneration", mode=c.PAUSE_MODE_WAIT)
            # The RPC returned only once the request had sent its natural terminal.
            assert mock.call_record("drain").ended == "finish" and mock.active_request_count() == 0
        assert messages[-1].outputs.finish_info.finish_reason == FinishReason.LENGTH
        assert mock.rl.pause_state is PauseState.PAUSED_NEW


async def test_sleep_wake_up_and_weight_rpcs_on_a_server_with_rl_enabled():
    async with running_mock(engine_args=RL_ON) as (mock, ch):
        await rpc(ch, "Sleep", level=2)
        assert (await rpc(ch, "IsSleeping")).sleeping and mock.rl.sleep_level == 2
        await rpc(ch, "WakeUp", tags=["weights"])
        assert (await rpc(ch, "IsSleeping")).sleeping
        await rpc(ch, "WakeUp")
        assert not (await rpc(ch, "IsSleeping")).sleeping and not (await rpc(ch, "IsPaused")).paused
        assert (await rpc(ch, "GetWeightVersion")).weight_version == "default"
        await rpc(ch, "InitWeightTransferEngine", init_info_json=b"{}")
        await rpc(ch, "StartWeightUpdate")
        await rpc(ch, "UpdateWeights", update_info_json=b'{"names": ["w"]}')
        await rpc(ch, "FinishWeightUpdate", weight_version="step-3")
        assert (await rpc(ch, "GetWeightVersion")).weight_version == "step-3"
        await rpc(ch, "StartDraftWeightUpdate")
        await rpc(ch, "FinishWeightUpdate")
        assert (await rpc(ch, "GetWeightVersion")).weight_version == "step-3"
        update = [req for name, req in mock.control_calls if name == "UpdateWeights"]
        assert [u.update_info_json for u in update] == [b'{"names": ["w"]}']


async def test_rl_rpcs_without_rl_enabled_fail_with_vllms_texts():
    async with running_mock() as (_, ch):
        assert await rpc_status(ch, "Sleep", level=1) == SLEEP_OFF
        assert await rpc_status(ch, "WakeUp") == SLEEP_OFF
        assert not (await rpc(ch, "IsSleeping")).sleeping
        for name, fields in (
            ("InitWeightTransferEngine", {"init_info_json": b"{}"}),
            ("StartWeightUpdate", {}),
            ("StartDraftWeightUpdate", {}),
            ("UpdateWeights", {"update_info_json": b"{}"}),
            ("FinishWeightUpdate", {"weight_version": "v"}),
        ):
            assert await rpc_status(ch, name, **fields) == TRANSFER_OFF, name
        await rpc(ch, "UpdateWeightVersion", weight_version="v7")
        assert (await rpc(ch, "GetWeightVersion")).weight_version == "v7"
        assert await rpc_status(ch, "UpdateWeightVersion") == (C.INVALID_ARGUMENT, "weight_version must not be empty")


# --- grpcio, the reference client ----------------------------------------------------------------------


async def test_grpcio_drives_lora_and_rl_rpcs_with_vllms_statuses():
    pytest.importorskip("grpc")
    from grpc import aio

    def unary(channel, name):
        return channel.unary_unary(
            f"/vllm.Control/{name}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=getattr(c, f"{name}Response").FromString,
        )

    async def scenario(channel):
        out = []
        for name, fields in (
            ("LoadLora", {"lora_name": "a", "source_path": "/adapters/a"}),
            ("LoadLora", {"lora_name": "a", "source_path": "/adapters/a"}),
            ("ListLoras", {}),
            ("UnloadLora", {"lora_name": "zz"}),
            ("PauseGeneration", {"mode": c.PAUSE_MODE_KEEP}),
            ("IsPaused", {}),
            ("Sleep", {"level": 1}),
            ("UpdateWeightVersion", {"weight_version": "v2"}),
            ("GetWeightVersion", {}),
        ):
            try:
                out.append(("OK", await unary(channel, name)(getattr(c, f"{name}Request")(**fields))))
            except aio.AioRpcError as err:
                out.append((err.code().name, err.details()))
        generate = channel.unary_unary(
            "/vllm.Inference/Generate",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.GenerateResponse.FromString,
        )
        out.append(("OK", await generate(gen("g", max_new_tokens=2, lora_name="a"))))
        return out

    async def main(address):
        async with aio.insecure_channel(address) as channel:
            return await scenario(channel)

    async with running_mock(engine_args={"max_loras": 1}) as (mock, _):
        out = await trio.to_thread.run_sync(asyncio.run, main(mock.address))
    assert out[0][0] == "OK" and out[0][1].adapter.lora_name == "a"
    assert out[1] == ("ALREADY_EXISTS", "LoRA adapter `a` is already loaded")
    assert [a.lora_name for a in out[2][1].adapters] == ["a"]
    assert out[3] == ("NOT_FOUND", "LoRA adapter `zz` is not loaded")
    assert out[4][0] == "OK" and out[5][1].paused
    assert out[6] == ("FAILED_PRECONDITION", "sleep mode is not configured; start vLLM with --enable-sleep-mode")
    assert out[7][0] == "OK" and out[8][1].weight_version == "v2"
    assert out[9][1].outputs.finish_info.num_output_tokens == 2
