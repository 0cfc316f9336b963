"""The embedded API's RL controls against the real mock over TCP (docs/rl.md#embedded-api): each method's Control
calls (the mock's recorder), its typed result, and the error family for argument and engine refusals."""

from __future__ import annotations

import pytest
from sidecar_fakes import FAST_ENGINE_ARGS, sidecar_config

from trio_sidecar import PauseMode, WakeState, open_sidecar
from trio_sidecar.core.errors import EngineShutdown, InvalidArgument
from trio_sidecar.core.rl_requests import RlCapabilities
from trio_sidecar.mock import MockConfig, open_mock_server

RL_ARGS = {"enable_sleep_mode": True, "weight_transfer_backend": "nccl", "enable_draft_weight_updates": True}


def mock_config(**engine_args):
    return MockConfig(listen="127.0.0.1:0", model="mocker-model", engine_args={**FAST_ENGINE_ARGS, **engine_args})


def calls_since(mock, start):
    return [(rpc, " ".join(str(request).split())) for rpc, request in mock.control_calls[start:]]


async def test_pause_resume_and_is_paused_make_natives_control_calls():
    async with open_mock_server(mock_config(**RL_ARGS)) as mock, open_sidecar(sidecar_config(mock.address)) as sidecar:
        assert sidecar.rl_capabilities == RlCapabilities(
            sleep_mode=True, weight_transfer=True, draft_weight_updates=True
        )
        start = len(mock.control_calls)
        await sidecar.pause_generation("keep", clear_cache=True)
        assert await sidecar.is_paused() is True
        assert mock.rl.paused
        assert await sidecar.resume_generation() == WakeState(sleeping=False)
        assert await sidecar.is_paused() is False
        await sidecar.pause_generation(PauseMode.WAIT)
        assert calls_since(mock, start) == [
            ("PauseGeneration", "mode: PAUSE_MODE_KEEP clear_cache: true"),
            ("IsPaused", ""),
            ("ResumeGeneration", ""),
            ("IsSleeping", ""),
            ("IsPaused", ""),
            ("PauseGeneration", "mode: PAUSE_MODE_WAIT"),
        ]


async def test_resume_on_a_server_without_sleep_mode_does_not_ask_is_sleeping():
    async with open_mock_server(mock_config()) as mock, open_sidecar(sidecar_config(mock.address)) as sidecar:
        start = len(mock.control_calls)
        await sidecar.pause_generation()
        assert await sidecar.resume_generation() == WakeState(sleeping=None)
        assert calls_since(mock, start) == [("PauseGeneration", "mode: PAUSE_MODE_ABORT"), ("ResumeGeneration", "")]


async def test_sleep_and_wake_up_report_whether_vllm_still_sleeps():
    async with open_mock_server(mock_config(**RL_ARGS)) as mock, open_sidecar(sidecar_config(mock.address)) as sidecar:
        start = len(mock.control_calls)
        await sidecar.sleep(2)
        assert await sidecar.is_sleeping() is True
        assert await sidecar.wake_up(["weights"]) == WakeState(sleeping=True)
        assert await sidecar.wake_up() == WakeState(sleeping=False)
        await sidecar.sleep(0, "keep")
        assert calls_since(mock, start)[:4] == [
            ("Sleep", "level: 2 mode: PAUSE_MODE_ABORT"),
            ("IsSleeping", ""),
            ("WakeUp", 'tags: "weights"'),
            ("IsSleeping", ""),
        ]
        assert calls_since(mock, start)[-1] == ("Sleep", "level: 0 mode: PAUSE_MODE_KEEP")


async def test_weight_update_cycle_and_version():
    async with open_mock_server(mock_config(**RL_ARGS)) as mock, open_sidecar(sidecar_config(mock.address)) as sidecar:
        start = len(mock.control_calls)
        await sidecar.init_weight_transfer_engine({"master_port": 1})
        await sidecar.start_weight_update()
        await sidecar.update_weights({"names": ["w"]})
        await sidecar.finish_weight_update("step-1")
        assert await sidecar.get_weight_version() == "step-1"
        await sidecar.start_weight_update(draft=True)
        await sidecar.finish_weight_update()
        await sidecar.update_weight_version("step-2")
        assert await sidecar.get_weight_version() == "step-2"
        assert calls_since(mock, start)[0] == ("InitWeightTransferEngine", 'init_info_json: "{\\"master_port\\":1}"')
        assert [rpc for rpc, _ in calls_since(mock, start)[1:]] == [
            "StartWeightUpdate",
            "UpdateWeights",
            "FinishWeightUpdate",
            "GetWeightVersion",
            "StartDraftWeightUpdate",
            "FinishWeightUpdate",
            "UpdateWeightVersion",
            "GetWeightVersion",
        ]


async def test_bad_arguments_are_refused_before_any_control_call():
    async with open_mock_server(mock_config(**RL_ARGS)) as mock, open_sidecar(sidecar_config(mock.address)) as sidecar:
        start = len(mock.control_calls)
        cases = [
            (sidecar.pause_generation("bogus"), "pause_generation mode must be abort, wait, or keep; got `bogus`"),
            (sidecar.sleep(3), "`level` must be one of 0, 1, or 2"),
            (sidecar.wake_up(["bogus"]), "wake_up tag must be weights, kv_cache, or scheduling; got `bogus`"),
            (sidecar.update_weight_version(""), "missing non-empty `new_version` string"),
        ]
        for call, message in cases:
            with pytest.raises(InvalidArgument) as caught:
                await call
            assert str(caught.value) == message
        assert mock.control_calls[start:] == []


async def test_engine_refusals_are_the_mapped_grpc_status():
    async with open_mock_server(mock_config()) as mock, open_sidecar(sidecar_config(mock.address)) as sidecar:
        with pytest.raises(InvalidArgument) as caught:
            await sidecar.sleep()
        assert str(caught.value) == (
            "Sleep: sleep mode is not configured; start vLLM with --enable-sleep-mode (FailedPrecondition)"
        )
        with pytest.raises(InvalidArgument, match=r"^StartWeightUpdate: weight transfer is not configured"):
            await sidecar.start_weight_update()
        assert [rpc for rpc, _ in mock.control_calls[-2:]] == ["Sleep", "StartWeightUpdate"]


async def test_after_the_block_the_controls_fail_with_engine_shutdown():
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            pass
        with pytest.raises(EngineShutdown):
            await sidecar.is_paused()
