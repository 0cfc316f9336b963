"""Fake-vLLM building blocks shared by the test areas' fake modules (``sidecar_fakes``, ``prober_fakes``,
``reliability_fakes``). It sits beside the root conftest, whose directory pytest puts on the import path.

Each builder takes keyword overrides, so an area states only what its tests depend on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from trio_sidecar._proto.vllm import control_pb2
from trio_sidecar.core.config import SidecarConfig


def model_info(**overrides: Any) -> control_pb2.ModelInfo:
    """A ``ModelInfo`` a sidecar accepts: token-id input, a model id and a served name."""
    fields: dict[str, Any] = dict(model_id="org/model", served_model_name="served-model", supports_token_ids_input=True)
    fields.update(overrides)
    return control_pb2.ModelInfo(**fields)


def server_info(*, instance_id: str = "instance-1", dp_size: int = 1, **overrides: Any) -> control_pb2.ServerInfo:
    """A vLLM 0.32 ``ServerInfo`` with ``dp_size`` data-parallel ranks (this one rank 0)."""
    fields: dict[str, Any] = dict(
        engine_version="0.32.0",
        api_version="vllm",
        instance_id=instance_id,
        parallelism=control_pb2.ParallelismInfo(
            tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=dp_size, data_parallel_rank=0
        ),
        max_model_len=4096,
        kv_block_size=16,
        total_kv_blocks=1024,
        max_running_requests=16,
        max_batched_tokens=2048,
    )
    fields.update(overrides)
    return control_pb2.ServerInfo(**fields)


def sidecar_config(endpoint: str, **overrides: Any) -> SidecarConfig:
    """Test defaults: 2 connections and quick retries; each area overrides its timeouts."""
    fields: dict[str, Any] = dict(grpc_endpoint=endpoint, grpc_connections=2, retry_interval=0.05)
    fields.update(overrides)
    return SidecarConfig(**fields)


async def wait_until(predicate: Callable[[], bool], *, timeout: float = 30.0, interval: float = 0.01) -> None:
    """Poll ``predicate`` until it holds; fails (``trio.TooSlowError``) after ``timeout`` seconds."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(interval)
