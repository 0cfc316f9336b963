"""End to end through ``open_sidecar`` against the real mock over TCP (docs/reference/sidecar.md#embedded-api),
KV events over ZMQ included: tokens and usage, the prefill handoff, cancellation, DP routing.

Cancellation tests assert what the mock observed: its active/running/waiting counts, its Abort log.
"""

from __future__ import annotations

import msgpack
import pytest
import trio
import zmq
from sidecar_fakes import FAST_ENGINE_ARGS, PausableProxy, sidecar_config

from trio_sidecar import GenerateContext, open_sidecar
from trio_sidecar.mock import MockConfig, open_mock_server, planned_tokens

SEED = 42


def mock_config(**overrides):
    engine_args = dict(FAST_ENGINE_ARGS)
    engine_args.update(overrides.pop("engine_args", {}))
    fields = dict(listen="127.0.0.1:0", model="mocker-model", seed=SEED, engine_args=engine_args)
    fields.update(overrides)
    return MockConfig(**fields)


async def collect(sidecar, body, ctx=None):
    async with sidecar.generate(body, ctx) as stream:
        return [chunk async for chunk in stream]


def usage(chunk):
    u = chunk.completion_usage
    return (u.prompt_tokens, u.completion_tokens, u.total_tokens)


async def wait_drained(mock, rank=0):
    await mock.metrics_value(rank).wait_value(lambda m: m.running_requests == 0 and m.waiting_requests == 0)
    while mock.active_request_count():
        await trio.sleep(0.01)


async def test_mock_streams_tokens_logprobs_and_usage():
    body = {
        "token_ids": [11, 22, 33, 44],
        "stop_conditions": {"max_tokens": 3, "ignore_eos": True},
        "sampling_options": {"temperature": 0.0},
        "output_options": {"logprobs": 2, "prompt_logprobs": 1},
    }
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            chunks = await collect(sidecar, body, GenerateContext("e2e-52"))
        assert mock.active_request_count() == 0
    expected = planned_tokens(SEED, "e2e-52", 3)
    assert [c.token_ids for c in chunks] == [[t] for t in expected]
    assert all(len(c.log_probs) == 1 for c in chunks)
    assert all(len(c.top_logprobs[0]) == 2 for c in chunks)  # docs/reference/sidecar.md#per-message-checks
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert usage(chunks[-1]) == (4, 3, 7)
    assert isinstance(chunks[-1].engine_data["prompt_logprobs"], list)
    assert chunks[0].engine_data is None


async def test_native_tokens_request_id_and_model_name():
    async with open_mock_server(mock_config(served_model_name="served-mock")) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            chunks = await collect(
                sidecar,
                {"token_ids": [5, 6, 7, 8, 9], "stop_conditions": {"max_tokens": 7}},
                GenerateContext("ctx-55"),
            )
        [(rpc, request, _metadata, _peer)] = mock.recorded_requests
    assert rpc == "GenerateStream"
    assert request.request_id == "ctx-55"
    assert request.model == "served-mock"
    assert [t for c in chunks for t in c.token_ids] == planned_tokens(SEED, "ctx-55", 7)
    assert chunks[-1].finish_reason == "length"
    assert usage(chunks[-1]) == (5, 7, 12)


async def test_dropping_the_sidecar_stream_cancels_mock_work():
    async with open_mock_server(mock_config(engine_args={"speedup_ratio": 0.1})) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            ctx = GenerateContext("drop-54")
            chunks = []
            async with sidecar.generate({"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 10000}}, ctx) as s:
                async for chunk in s:
                    chunks.append(chunk)
                    ctx.stop()
            with trio.fail_after(2):
                await wait_drained(mock)
                while not mock.abort_calls:
                    await trio.sleep(0.01)
    assert chunks[-1].finish_reason == "cancelled"
    assert usage(chunks[-1])[1] == len(chunks) - 1 >= 1
    assert ["drop-54"] in mock.abort_calls


async def test_prefill_handoff_round_trips_through_a_decode_mock():
    body = {"token_ids": [3, 1, 4, 1, 5, 9], "stop_conditions": {"max_tokens": 3}}
    async with (
        open_mock_server(mock_config(disaggregation_mode="prefill")) as prefill_mock,
        open_mock_server(mock_config(disaggregation_mode="decode")) as decode_mock,
    ):
        async with (
            open_sidecar(sidecar_config(prefill_mock.address, disaggregation_mode="prefill")) as prefill,
            open_sidecar(sidecar_config(decode_mock.address, disaggregation_mode="decode")) as decode,
        ):
            [prefill_chunk] = await collect(prefill, body, GenerateContext("pd-53"))
            handoff = prefill_chunk.disaggregated_params
            decode_body = dict(body, prefill_result={"disaggregated_params": handoff})
            chunks = await collect(decode, decode_body, GenerateContext("pd-53"))
    assert prefill_chunk.token_ids == []
    assert handoff["do_remote_prefill"] is True
    assert isinstance(handoff["remote_engine_id"], str)
    assert isinstance(handoff["mocker_request_id"], str)
    assert len(chunks) == 3
    assert chunks[-1].finish_reason == "length"
    [(_rpc, decode_request, _md, _peer)] = decode_mock.recorded_requests
    assert decode_request.kv.kv_transfer_params["remote_port"] == "0"


async def test_cancel_before_open_during_pending_open_and_during_pending_read():
    body = {"token_ids": [1, 2, 3, 4], "stop_conditions": {"max_tokens": 50}}
    async with open_mock_server(mock_config(engine_args={"speedup_ratio": 0.05})) as mock:
        async with trio.open_nursery() as nursery:
            proxy = await nursery.start(PausableProxy("127.0.0.1", mock.port).serve)
            async with open_sidecar(sidecar_config(proxy.endpoint)) as sidecar:
                # before open: nothing reaches the server
                ctx = GenerateContext("before")
                ctx.stop()
                [chunk] = await collect(sidecar, body, ctx)
                assert chunk.finish_reason == "cancelled" and usage(chunk) == (4, 0, 4)
                assert mock.recorded_requests == []

                # pending open: the mock got the request, its answer is held by the proxy
                proxy.pause()
                ctx = GenerateContext("open")

                async def stop_when_seen():
                    while not mock.recorded_requests:
                        await trio.sleep(0.01)
                    ctx.stop()

                nursery.start_soon(stop_when_seen)
                with trio.fail_after(2):
                    [chunk] = await collect(sidecar, body, ctx)
                assert chunk.finish_reason == "cancelled" and usage(chunk) == (4, 0, 4)
                with trio.fail_after(2):
                    await wait_drained(mock)
                proxy.resume()

                # pending read: tokens already delivered are kept, the RPC is dropped
                ctx = GenerateContext("read")
                chunks = []
                async with sidecar.generate(body, ctx) as stream:
                    async for chunk in stream:
                        chunks.append(chunk)
                        if len(chunks) == 2:
                            proxy.pause()
                            nursery.start_soon(_stop_later, ctx)
                with trio.fail_after(2):
                    await wait_drained(mock)
                proxy.resume()
            nursery.cancel_scope.cancel()
    assert [c.token_ids for c in chunks[:2]] == [[t] for t in planned_tokens(SEED, "read", 2)]
    assert chunks[-1].finish_reason == "cancelled"
    assert usage(chunks[-1])[1] >= 2


async def _stop_later(ctx):
    await trio.sleep(0.1)
    ctx.stop()


async def test_data_parallel_rank_is_served_by_that_rank():
    engine_args = {"dp_size": 2, "enable_prefix_caching": True, "speedup_ratio": 0.05}
    async with open_mock_server(mock_config(engine_args=engine_args)) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            sources = sidecar.kv_event_sources
            assert sidecar.engine_config.data_parallel_size == 2
            ctx = GenerateContext("dp-57")
            body = {"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 10000}, "routing": {"dp_rank": 1}}
            async with sidecar.generate(body, ctx) as stream:
                async for _chunk in stream:
                    assert mock.metrics(1).running_requests == 1
                    assert mock.metrics(0).running_requests == 0
                    ctx.stop()
            with trio.fail_after(2):
                await wait_drained(mock, 1)
    assert sorted(s.dp_rank for s in sources) == [0, 1]
    assert sorted(s.endpoint for s in sources) == sorted(mock.kv_event_endpoints)
    assert mock.recorded_requests[0][1].request_id == "dp-57"
    assert ("x-data-parallel-rank", "1") in tuple(mock.recorded_requests[0][2])


async def test_out_of_range_dp_rank_gets_the_server_error():
    async with open_mock_server(mock_config(engine_args={"dp_size": 2})) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            with pytest.raises(Exception) as info:
                await collect(sidecar, {"token_ids": [1], "routing": {"dp_rank": 5}})
    assert info.value.kind.name == "INVALID_ARGUMENT"
    assert str(info.value) == (
        "GenerateStream: engine-core error: data parallel rank 5 is not connected to this frontend; "
        "connected ranks: [0, 1] (InvalidArgument)"
    )


# ----------------------------------------------------------------------------------------- KV events over ZMQ


class _Subscriber:
    """A ZMQ SUB socket polled from Trio without blocking the loop (non-blocking recv + short sleeps)."""

    def __init__(self, context: zmq.Context, endpoint: str, topic: str) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)
        self.messages: list[tuple[int, list]] = []  # (seq, payload)

    def poll(self) -> None:
        while True:
            try:
                _topic, seq, payload = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.messages.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))

    def events(self, kind: str) -> list[dict]:
        return [e for _seq, (_ts, events, _rank) in self.messages for e in events if e["type"] == kind]

    def close(self) -> None:
        self.socket.close(linger=0)


async def _poll_until(subscribers, predicate, timeout=5.0):
    with trio.fail_after(timeout):
        while True:
            for sub in subscribers:
                sub.poll()
            if predicate():
                return
            await trio.sleep(0.02)


async def test_kv_events_reach_subscribers_of_the_validated_sources():
    engine_args = {"dp_size": 2, "enable_prefix_caching": True, "num_gpu_blocks": 4, "block_size": 4}
    context = zmq.Context()
    subscribers = []
    try:
        async with open_mock_server(mock_config(engine_args=engine_args)) as mock:
            async with open_sidecar(sidecar_config(mock.address)) as sidecar:
                by_rank = {s.dp_rank: s for s in sidecar.kv_event_sources}
                subscribers = [_Subscriber(context, by_rank[r].endpoint, by_rank[r].topic) for r in (0, 1)]
                # ZMQ slow joiner: what is published before a subscription is in place is lost, so probe each
                # rank with empty batches (they only advance its sequence number) until its subscriber has one
                with trio.fail_after(10):
                    for rank, sub in enumerate(subscribers):
                        while not sub.messages:
                            mock._publishers[rank].publish([])
                            await trio.sleep(0.02)
                            sub.poll()
                sub0 = subscribers[0]
                # 2-block prompt on rank 0, 1 output token: two full blocks stored
                prompt = [101, 102, 103, 104, 105, 106, 107, 108]
                body = {"token_ids": prompt, "stop_conditions": {"max_tokens": 1}, "routing": {"dp_rank": 0}}
                await collect(sidecar, body)
                await _poll_until(subscribers, lambda: len(sub0.events("BlockStored")) >= 1)
                stored_hashes = [h for e in sub0.events("BlockStored") for h in e["block_hashes"]]
                stored_tokens = [t for e in sub0.events("BlockStored") for t in e["token_ids"]]
                assert stored_tokens[:8] == prompt
                assert len(stored_hashes) >= 2
                # a different prompt that needs the whole pool evicts the cached blocks
                other = {
                    "token_ids": list(range(200, 216)),
                    "stop_conditions": {"max_tokens": 1},
                    "routing": {"dp_rank": 0},
                }
                await collect(sidecar, other)
                await _poll_until(
                    subscribers,
                    lambda: (
                        set(stored_hashes[:2]) <= {h for e in sub0.events("BlockRemoved") for h in e["block_hashes"]}
                    ),
                )
        for sub in subscribers:
            sub.poll()
        seqs = [seq for seq, _payload in subscribers[0].messages]
        assert seqs == sorted(set(seqs)) and len([m for m in subscribers[0].messages if m[1][1]]) >= 2
        assert all(rank == 0 for _seq, (_ts, _events, rank) in subscribers[0].messages)
        assert [events for _seq, (_ts, events, _rank) in subscribers[1].messages if events] == []  # rank 1: nothing
    finally:
        for sub in subscribers:
            sub.close()
        context.term()


async def test_connection_lost_mid_stream_keeps_the_token_and_the_slot_reconnects():
    body = {"token_ids": [1, 2, 3, 4], "stop_conditions": {"max_tokens": 50}}
    async with open_mock_server(mock_config(engine_args={"speedup_ratio": 0.05})) as mock:
        async with trio.open_nursery() as nursery:
            proxy = await nursery.start(PausableProxy("127.0.0.1", mock.port).serve)
            async with open_sidecar(sidecar_config(proxy.endpoint, grpc_connections=1)) as sidecar:
                chunks = []
                with pytest.raises(Exception) as info:
                    async with sidecar.generate(body, GenerateContext("lost")) as stream:
                        async for chunk in stream:
                            chunks.append(chunk)
                            proxy.break_connections()
                assert info.value.kind.name == "CANNOT_CONNECT"
                assert str(info.value).startswith("GenerateStream: ")
                assert str(info.value).endswith("(Unavailable)")
                assert len(chunks) >= 1 and chunks[0].token_ids
                with trio.fail_after(2):
                    await wait_drained(mock)  # the mock saw the disconnect
                # the broken slot is replaced by the next RPC (docs/reference/sidecar.md#reconnection-after-startup)
                again = await collect(sidecar, dict(body, stop_conditions={"max_tokens": 3}))
                assert again[-1].finish_reason == "length"
                assert sidecar.engine.pool.reconnects == 1
                stats = sidecar.stats()
                assert (stats.pool_connections, stats.pool_connections_up) == (1, 1)
                assert (stats.pool_reconnects, stats.pool_reconnect_failures) == (1, 0)
                assert stats.request_errors["cannot_connect"] == 1 and stats.requests_finished["length"] == 1
            nursery.cancel_scope.cancel()


async def test_the_contexts_trace_headers_reach_vllm_as_generatestream_metadata():
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    body = {"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 2}}
    async with open_mock_server(mock_config(engine_args={"dp_size": 2})) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            ctx = GenerateContext("traced", traceparent=traceparent, tracestate="rojo=00f067aa0ba902b7")
            with trio.fail_after(10):
                await collect(sidecar, dict(body, routing={"dp_rank": 1}), ctx)
                await collect(sidecar, body, GenerateContext("untraced"))
    assert mock.trace_headers == {"traced": {"traceparent": traceparent, "tracestate": "rojo=00f067aa0ba902b7"}}
    # alongside the DP-rank metadata, which still routes the request
    traced_metadata = dict(mock.recorded_requests[0][2])
    assert traced_metadata["x-data-parallel-rank"] == "1" and traced_metadata["traceparent"] == traceparent
