"""Shared helpers for the mock-server tests (imported as ``mock_helpers``; tests/ has no packages).

An in-process mock on 127.0.0.1 port 0 and a channel to it, request builders and stream collectors.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from trio_sidecar._proto.vllm import control_pb2
from trio_sidecar._proto.vllm import inference_pb2 as pb

# The upstream tests' "admitting args" (docs/reference/mock.md#in-process-api-and-test-hooks).
FAST_ARGS: dict[str, Any] = {
    "block_size": 4,
    "enable_prefix_caching": False,
    "num_gpu_blocks": 4096,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 1024,
    "speedup_ratio": 0.0,
}

GENERATE = "/vllm.Inference/Generate"
GENERATE_STREAM = "/vllm.Inference/GenerateStream"
FinishReason = pb.FinishInfo.FinishReason


@asynccontextmanager
async def running_mock(**config: Any) -> AsyncIterator[tuple[Any, Any]]:
    """Start a mock (``FAST_ARGS`` overlaid with ``engine_args``) and open a channel to it."""
    from trio_sidecar.mock import MockConfig, open_mock_server
    from trio_sidecar.transport import open_channel

    engine_args = {**FAST_ARGS, **config.pop("engine_args", {})}
    config.setdefault("listen", "127.0.0.1:0")
    async with open_mock_server(MockConfig(engine_args=engine_args, **config)) as mock:
        async with open_channel("127.0.0.1", mock.port) as channel:
            yield mock, channel


def gen(request_id: str = "r", prompt: Sequence[int] = (1, 2, 3, 4), **kw: Any) -> pb.GenerateRequest:
    """A ``GenerateRequest`` with a token-id prompt; ``max_new_tokens=`` etc. go to ``stopping``."""
    stopping = {k: kw.pop(k) for k in ("max_new_tokens", "min_new_tokens", "stop_token_ids") if k in kw}
    kw.setdefault("response", pb.ResponseOptions(output_token_ids=True))
    kw.setdefault("stopping", pb.StoppingCriteria())
    request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=list(prompt)), **kw)
    for key, value in stopping.items():
        if key == "stop_token_ids":
            request.stopping.stop_token_ids.extend(value)
        else:
            setattr(request.stopping, key, value)
    return request


async def collect(channel: Any, request: pb.GenerateRequest, metadata: Sequence[tuple[str, str]] = ()) -> list[Any]:
    """Every message of a ``GenerateStream`` (raises ``RpcError`` for a non-OK status)."""
    out = []
    async with channel.unary_stream(GENERATE_STREAM, request, pb.GenerateResponse, metadata=metadata) as stream:
        async for message in stream:
            out.append(message)
    return out


def stream_tokens(messages: Sequence[pb.GenerateResponse]) -> list[int]:
    return [t for m in messages if m.HasField("outputs") for t in m.outputs.token_ids]


async def control(channel: Any, rpc: str, request: Any, response_type: Any) -> Any:
    return await channel.unary_unary(f"/vllm.Control/{rpc}", request, response_type)


async def abort(channel: Any, *request_ids: str) -> None:
    await control(channel, "Abort", control_pb2.AbortRequest(request_ids=list(request_ids)), control_pb2.AbortResponse)


async def wait_drained(mock: Any, rank: int = 0, timeout: float = 2.0) -> None:
    """Wait (bounded by the documented 2 s, docs/reference/mock.md#cancellation-and-abort) until the rank has no running/waiting request and no route is left."""
    with trio.fail_after(timeout):
        await mock.metrics_value(rank).wait_value(lambda m: m.running_requests == 0 and m.waiting_requests == 0)
        while mock.active_request_count():
            await trio.sleep(0.01)
