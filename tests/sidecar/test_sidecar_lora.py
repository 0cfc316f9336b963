"""The embedded LoRA API (docs/lora.md#embedded-api): ``Sidecar.list_loras`` / ``load_lora`` /
``unload_lora`` against the mock, the Control calls each makes, generation with an adapter, and the reload
of the adapters after the mock is restarted on the same port (docs/lora.md#reconciliation).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import trio

from trio_sidecar import GenerateContext, open_sidecar
from trio_sidecar.core.config import SidecarConfig
from trio_sidecar.core.errors import CannotConnect, InvalidArgument, ProtocolError, UnknownError, status_to_error
from trio_sidecar.core.health_policy import HealthKind
from trio_sidecar.core.lora_requests import (
    LORA_UNSUPPORTED,
    LoadRequest,
    LoadResult,
    LoraAdapter,
    check_adapter_directory,
)
from trio_sidecar.core.status import StatusCode
from trio_sidecar.shell.lora_lifecycle import LoraLifecycle

ENGINE_ARGS = {"block_size": 4, "enable_prefix_caching": False, "speedup_ratio": 0.0}
WAIT = 30.0


class _Mock:
    """A mock "vLLM process" on a fixed 127.0.0.1 port that can be stopped and started again."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.port = 0
        self.mock = None
        self._stop = trio.Event()
        self._done = trio.Event()

    async def start(self, max_loras: int = 2) -> object:
        from trio_sidecar.mock import MockConfig, open_mock_server

        config = MockConfig(
            listen=f"127.0.0.1:{self.port}",
            model="mocker-model",
            served_model_name="tiny",
            engine_args={**ENGINE_ARGS, "max_loras": max_loras},
        )
        self._stop, self._done = trio.Event(), trio.Event()
        stop, done = self._stop, self._done

        async def run(task_status=trio.TASK_STATUS_IGNORED):
            try:
                async with open_mock_server(config) as mock:
                    task_status.started(mock)
                    await stop.wait()
            finally:
                done.set()

        self.mock = await self.nursery.start(run)
        self.port = self.mock.port
        return self.mock

    async def stop(self) -> None:
        self._stop.set()
        await self._done.wait()

    def calls(self, start: int = 0) -> list[tuple[str, ...]]:
        out = []
        for name, request in self.mock.control_calls[start:]:
            if name == "LoadLora":
                out.append((name, request.lora_name, request.source_path))
            elif name == "UnloadLora":
                out.append((name, request.lora_name))
            elif name in ("ListLoras",):
                out.append((name,))
        return out


def config_for(port: int, **overrides) -> SidecarConfig:
    fields = dict(
        grpc_endpoint=f"127.0.0.1:{port}",
        grpc_connections=1,
        connect_attempt_timeout=15.0,
        retry_interval=0.05,
        startup_deadline=30.0,
    )
    fields.update(overrides)
    return SidecarConfig(**fields)


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    return tmp_path


async def generate(sidecar, lora_name: str | None, request_id: str) -> list:
    body: dict = {"token_ids": [11, 22, 33], "stop_conditions": {"max_tokens": 2, "ignore_eos": True}}
    if lora_name is not None:
        body["routing"] = {"lora_name": lora_name}
    async with sidecar.generate(body, GenerateContext(request_id)) as stream:
        return [chunk async for chunk in stream]


async def test_load_list_generate_unload_through_the_embedded_api(nursery, adapter):
    runner = _Mock(nursery)
    mock = await runner.start()
    with trio.fail_after(60):
        async with open_sidecar(config_for(runner.port, health_prober=False)) as sidecar:
            start = len(mock.control_calls)
            assert await sidecar.list_loras() == []
            result = await sidecar.load_lora("a", str(adapter))
            assert result == LoadResult(LoraAdapter("a", 1, str(adapter)), already_loaded=False)
            # The first call also reconciles (one more ListLoras); later ones do not.
            assert runner.calls(start) == [
                ("ListLoras",),
                ("ListLoras",),
                ("ListLoras",),
                ("LoadLora", "a", str(adapter)),
            ]
            again = await sidecar.load_lora("a", f"file://{adapter}/other")
            assert again == LoadResult(LoraAdapter("a", 1, str(adapter)), already_loaded=True)
            assert await sidecar.list_loras() == [LoraAdapter("a", 1, str(adapter))]

            chunks = await generate(sidecar, "a", "with-a")
            assert sum(len(c.token_ids) for c in chunks) == 2
            request = next(
                r for rpc, r, *_ in mock.recorded_requests if rpc == "GenerateStream" and r.request_id == "with-a"
            )
            assert (request.lora_name, request.model) == ("a", "tiny")
            with pytest.raises(InvalidArgument) as unknown:
                await generate(sidecar, "zz", "with-zz")
            assert str(unknown.value) == "GenerateStream: LoRA adapter `zz` is not loaded (NotFound)"

            start = len(mock.control_calls)
            assert await sidecar.unload_lora("a") == LoraAdapter("a", 1, str(adapter))
            assert runner.calls(start) == [("ListLoras",), ("UnloadLora", "a")]
            with pytest.raises(InvalidArgument) as missing:
                await sidecar.unload_lora("a")
            assert str(missing.value) == "LoRA adapter 'a' not found. Available LoRAs: []"


async def test_the_embedded_api_refuses_with_the_native_texts(nursery, adapter, tmp_path):
    runner = _Mock(nursery)
    mock = await runner.start(max_loras=1)
    with trio.fail_after(60):
        async with open_sidecar(config_for(runner.port, health_prober=False)) as sidecar:
            await sidecar.list_loras()
            start = len(mock.control_calls)
            with pytest.raises(InvalidArgument) as conflict:
                await sidecar.load_lora("tiny", str(adapter))
            assert str(conflict.value) == "LoRA adapter `tiny` conflicts with the base model name or one of its aliases"
            with pytest.raises(ProtocolError) as nope:
                await sidecar.load_lora("b", f"{tmp_path}/nope")
            assert str(nope.value).endswith(f"Local LoRA not found: file://{tmp_path}/nope")
            with pytest.raises(InvalidArgument) as relative:
                await sidecar.load_lora("b", "file://relative/x")
            assert "absolute local path" in str(relative.value)
            assert "LoadLora" not in [call[0] for call in runner.calls(start)]
            await sidecar.load_lora("a", str(adapter))
            with pytest.raises(InvalidArgument) as full:
                await sidecar.load_lora("b", str(adapter))
            assert str(full.value) == "LoRA capacity exceeded: at most 1 adapter(s) may be loaded"
            sidecar.lora.hot_swap = True
            with pytest.raises(InvalidArgument) as swap:
                await sidecar.load_lora("a", str(adapter))
            assert "hot swap is not supported by the gRPC backend" in str(swap.value)


class _MapResolver:
    """An embedder's resolver: maps remote URIs to directories it already has."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths = paths
        self.asked: list[str] = []

    async def resolve(self, request: LoadRequest) -> str:
        self.asked.append(request.uri)
        return check_adapter_directory(self.paths[request.uri])


async def test_remote_sources_need_a_resolver_and_ambiguous_discovery_keys_are_refused(nursery, adapter):
    runner = _Mock(nursery)
    mock = await runner.start()
    with trio.fail_after(60):
        async with open_sidecar(config_for(runner.port, health_prober=False)) as sidecar:
            await sidecar.list_loras()
            with pytest.raises(InvalidArgument) as remote:
                await sidecar.load_lora("h", "s3://bucket/a")
            assert str(remote.value) == (
                "LoRA source `s3://bucket/a` is not supported without a source resolver: only file:// sources "
                "are loaded (see docs/lora.md#sources)"
            )
            resolver = _MapResolver({"hf://org/adapter": str(adapter)})
            sidecar.lora.resolver = resolver
            start = len(mock.control_calls)
            result = await sidecar.load_lora("H.1", "hf://org/adapter")
            assert result == LoadResult(LoraAdapter("H.1", 1, str(adapter)), already_loaded=False)
            assert runner.calls(start)[-1] == ("LoadLora", "H.1", str(adapter))
            with pytest.raises(InvalidArgument) as clash:
                await sidecar.load_lora("h_1", "hf://org/adapter")
            assert str(clash.value) == (
                "LoRA adapter `h_1` derives the discovery suffix `h_1`, which is already used by loaded adapter "
                "`H.1`; publishing it would overwrite that adapter's discovery record"
            )
            assert resolver.asked == ["hf://org/adapter"]  # the name checks come before the source
            # Another client loads the clashing name into vLLM: a list is refused, an unload is not.
            mock.lora.load("h_1", str(adapter))
            with pytest.raises(ProtocolError) as ambiguous:
                await sidecar.list_loras()
            assert str(ambiguous.value) == (
                "invalid vLLM gRPC response: adapter `h_1` derives the discovery suffix `h_1`, which another "
                "loaded adapter already uses"
            )
            assert (await sidecar.unload_lora("h_1")).name == "h_1"
            assert [a.name for a in await sidecar.list_loras()] == ["H.1"]


async def test_without_lora_support_the_api_refuses_and_lora_name_is_rejected_locally(nursery, adapter):
    runner = _Mock(nursery)
    await runner.start(max_loras=0)
    with trio.fail_after(60):
        async with open_sidecar(config_for(runner.port, health_prober=False)) as sidecar:
            for call in (sidecar.list_loras(), sidecar.load_lora("a", str(adapter)), sidecar.unload_lora("a")):
                with pytest.raises(InvalidArgument) as info:
                    await call
                assert str(info.value) == LORA_UNSUPPORTED
            with pytest.raises(InvalidArgument) as info:
                await generate(sidecar, "a", "no-lora")
            assert str(info.value) == "LoRA request selection is not supported by vLLM gRPC"
    assert runner.calls() == []


async def test_adapters_loaded_through_the_sidecar_are_loaded_again_after_a_vllm_restart(nursery, adapter, caplog):
    caplog.set_level(logging.INFO, logger="trio_sidecar.lora")
    runner = _Mock(nursery)
    await runner.start()
    with trio.fail_after(90):
        async with open_sidecar(config_for(runner.port)) as sidecar:
            await sidecar.load_lora("a", str(adapter))
            await sidecar.load_lora("b", str(adapter))
            await runner.stop()
            with trio.fail_after(WAIT):
                await sidecar.health.wait_value(lambda s: s.kind is not HealthKind.SERVING)
            mock = await runner.start()
            with trio.fail_after(WAIT):
                while [a.lora_name for a in mock.lora] != ["a", "b"]:
                    await trio.sleep(0.02)
            assert runner.calls() == [
                ("ListLoras",),
                ("LoadLora", "a", str(adapter)),
                ("LoadLora", "b", str(adapter)),
            ]
            chunks = await generate(sidecar, "b", "after-restart")
            assert sum(len(c.token_ids) for c in chunks) == 2
            assert [a.name for a in await sidecar.list_loras()] == ["a", "b"]
    assert "loaded 2 LoRA adapter(s) again after the vLLM restart: a, b" in caplog.text


class _FailingPublisher:
    """Fault injection: the discovery record cannot be written."""

    def __init__(self) -> None:
        self.unpublished: list[str] = []

    async def publish(self, adapter: LoraAdapter, max_loras: int) -> None:
        raise UnknownError(f"failed to publish the discovery record of LoRA `{adapter.name}`: discovery is down")

    async def unpublish(self, name: str) -> None:
        self.unpublished.append(name)


async def test_a_load_whose_discovery_record_cannot_be_published_is_rolled_back(nursery, adapter):
    runner = _Mock(nursery)
    mock = await runner.start()
    with trio.fail_after(60):
        async with open_sidecar(config_for(runner.port, health_prober=False)) as sidecar:
            await sidecar.list_loras()
            sidecar.lora.publisher = _FailingPublisher()
            start = len(mock.control_calls)
            with pytest.raises(UnknownError) as info:
                await sidecar.load_lora("a", str(adapter))
            assert str(info.value) == "failed to publish the discovery record of LoRA `a`: discovery is down"
            assert runner.calls(start) == [("ListLoras",), ("LoadLora", "a", str(adapter)), ("UnloadLora", "a")]
            assert list(mock.lora) == []
            assert sidecar.lora.loaded_here == {} and sidecar.lora.published == set()


class _RecordingPublisher:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    async def publish(self, adapter: LoraAdapter, max_loras: int) -> None:
        self.events.append(("publish", adapter.name))

    async def unpublish(self, name: str) -> None:
        self.events.append(("unpublish", name))


class _FaultyPool:
    """Fault injection around the engine's pool: the next call of an RPC runs on the server (or not) and
    then fails with the given status, as a lost answer or a refusal would."""

    def __init__(self, pool) -> None:
        self._pool = pool
        self.faults: dict[str, tuple[bool, StatusCode, str]] = {}

    async def unary(self, rpc, method, request, response_type, **kw):
        fault = self.faults.pop(rpc, None)
        if fault is None:
            return await self._pool.unary(rpc, method, request, response_type, **kw)
        run_first, code, message = fault
        if run_first:
            await self._pool.unary(rpc, method, request, response_type, **kw)
        raise status_to_error(rpc, code, message)


async def _lifecycle(sidecar) -> tuple[LoraLifecycle, _FaultyPool, _RecordingPublisher]:
    pool = _FaultyPool(sidecar.engine.pool)
    publisher = _RecordingPublisher()
    lifecycle = LoraLifecycle(lambda: pool, lambda: sidecar.model, publisher=publisher)
    await lifecycle.reconcile()
    return lifecycle, pool, publisher


async def test_a_load_whose_answer_is_lost_or_that_raced_another_load_is_decided_by_list_loras(nursery, adapter):
    runner = _Mock(nursery)
    mock = await runner.start()
    with trio.fail_after(60):
        async with open_sidecar(config_for(runner.port, health_prober=False)) as sidecar:
            lifecycle, pool, publisher = await _lifecycle(sidecar)
            # The server loaded it, the answer was lost: ListLoras shows it from the same directory.
            pool.faults["LoadLora"] = (True, StatusCode.UNAVAILABLE, "connection reset")
            result = await lifecycle.load("a", f"file://{adapter}")
            assert result == LoadResult(LoraAdapter("a", 1, str(adapter)), already_loaded=False)
            assert publisher.events == [("publish", "a")] and lifecycle.loaded_here == {"a": str(adapter)}
            # The load was refused and nothing was loaded: the error stands.
            pool.faults["LoadLora"] = (False, StatusCode.UNAVAILABLE, "connection reset")
            with pytest.raises(CannotConnect):
                await lifecycle.load("b", f"file://{adapter}")
            assert [a.lora_name for a in mock.lora] == ["a"] and "b" not in lifecycle.loaded_here
            # Another client loaded the name between our ListLoras and LoadLora.
            pool.faults["LoadLora"] = (True, StatusCode.ALREADY_EXISTS, "LoRA adapter `c` is already loaded")
            raced = await lifecycle.load("c", f"file://{adapter}")
            assert raced.already_loaded and raced.adapter.name == "c"


async def test_a_lost_load_answer_is_not_decided_from_an_ambiguous_adapter_list(nursery, adapter):
    runner = _Mock(nursery)
    mock = await runner.start()
    with trio.fail_after(60):
        async with open_sidecar(config_for(runner.port, health_prober=False)) as sidecar:
            lifecycle, pool, publisher = await _lifecycle(sidecar)

            class _RacingClient:  # another client loads clashing names while this load is under way
                async def resolve(self, request: LoadRequest) -> str:
                    mock.lora.load("Z.z", str(adapter))
                    mock.lora.load("z_z", str(adapter))
                    return check_adapter_directory(str(adapter))

            lifecycle.resolver = _RacingClient()
            pool.faults["LoadLora"] = (True, StatusCode.UNAVAILABLE, "connection reset")
            with pytest.raises(ProtocolError) as info:
                await lifecycle.load("a", f"file://{adapter}")
            assert str(info.value) == (
                "invalid vLLM gRPC response: adapter `z_z` derives the discovery suffix `z_z`, which another "
                "loaded adapter already uses"
            )
            assert publisher.events == [] and lifecycle.loaded_here == {}


async def test_a_failed_unload_keeps_the_adapter_routable_and_a_lost_answer_counts_as_done(nursery, adapter):
    runner = _Mock(nursery)
    mock = await runner.start()
    with trio.fail_after(60):
        async with open_sidecar(config_for(runner.port, health_prober=False)) as sidecar:
            lifecycle, pool, publisher = await _lifecycle(sidecar)
            await lifecycle.load("a", f"file://{adapter}")
            publisher.events.clear()
            pool.faults["UnloadLora"] = (False, StatusCode.INTERNAL, "engine busy")
            with pytest.raises(UnknownError) as info:
                await lifecycle.unload("a")
            assert str(info.value) == "UnloadLora: engine busy (Internal)"
            assert publisher.events == [("unpublish", "a"), ("publish", "a")]
            assert lifecycle.published == {"a"} and lifecycle.loaded_here == {"a": str(adapter)}
            publisher.events.clear()
            pool.faults["UnloadLora"] = (True, StatusCode.UNAVAILABLE, "connection reset")
            assert await lifecycle.unload("a") == LoraAdapter("a", 1, str(adapter))
            # (The failed unload left the state unsure: this call began with a reconciliation, which republished.)
            assert publisher.events == [("publish", "a"), ("unpublish", "a")] and list(mock.lora) == []


async def test_concurrent_loads_cannot_overshoot_max_loras(nursery, adapter):
    runner = _Mock(nursery)
    mock = await runner.start(max_loras=1)
    outcomes: dict[str, object] = {}
    with trio.fail_after(60):
        async with open_sidecar(config_for(runner.port, health_prober=False)) as sidecar:

            async def load(name: str) -> None:
                try:
                    outcomes[name] = await sidecar.load_lora(name, str(adapter))
                except InvalidArgument as exc:
                    outcomes[name] = str(exc)

            async with trio.open_nursery() as loads:
                for name in ("a", "b", "c"):
                    loads.start_soon(load, name)
    refused = [v for v in outcomes.values() if isinstance(v, str)]
    assert refused == ["LoRA capacity exceeded: at most 1 adapter(s) may be loaded"] * 2
    assert len(list(mock.lora)) == 1
    assert [c[0] for c in runner.calls()].count("LoadLora") == 1


async def test_a_reload_that_failed_is_retried_by_the_next_operation(nursery, adapter):
    runner = _Mock(nursery)
    mock = await runner.start()
    with trio.fail_after(60):
        async with open_sidecar(config_for(runner.port, health_prober=False)) as sidecar:
            lifecycle, pool, _ = await _lifecycle(sidecar)
            await lifecycle.load("a", f"file://{adapter}")
            mock.lora.unload("a")  # vLLM lost it (as a restarted vLLM would)
            lifecycle.request_reconcile()  # what the prober's recovery does
            pool.faults["ListLoras"] = (False, StatusCode.UNAVAILABLE, "connection reset")
            assert await lifecycle.list_adapters() == []  # the reload pass failed; this call's own list answers
            assert lifecycle.loaded_here == {"a": str(adapter)}
            assert [a.name for a in await lifecycle.list_adapters()] == ["a"]  # retried, and loaded again
            assert [a.lora_name for a in mock.lora] == ["a"]
