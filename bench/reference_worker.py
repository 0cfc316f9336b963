#!/usr/bin/env python3
"""The reference Python worker of ``bench/e2e.py --reference``: the most direct Python design, for comparison.

Usage: python bench/reference_worker.py MODEL_DIR NAMESPACE GRPC_ADDRESS SERVED_MODEL_NAME

A plain Dynamo 1.6.1 worker on one uvloop loop, the one Dynamo's runtime runs on: each request is forwarded
to vLLM's ``GenerateStream`` with ``grpc.aio`` (grpcio) in that loop, converted by trio-sidecar's pure core
(``structure_request``, ``build_generate_request``, ``ResponseState``: the same mapping and output dicts as
trio-sidecar), and answered on the push egress (a ``response_sender`` parameter, one ``send`` per chunk, as
trio-sidecar does within its inline window). A watcher on ``context.async_killed_or_stopped()`` cancels the
call. No Trio, no second thread, no hand-over between loops: what a Python worker costs on Dynamo when it
does only the necessary work with the stock asyncio gRPC stack.

Benchmark scaffolding only: no discovery through Control (the served name is given), no runtime config in
the model card, no KV events, no disaggregation, no error translation.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import grpc
import uvloop
from dynamo.llm import ModelInput, ModelType, WorkerType, register_model
from dynamo.runtime import DistributedRuntime

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trio_sidecar._proto.vllm import inference_pb2
from trio_sidecar.core.config import DisaggregationMode
from trio_sidecar.core.convert.request import build_generate_request
from trio_sidecar.core.convert.response import ResponseState
from trio_sidecar.core.protocol import structure_request

GENERATE_STREAM = "/vllm.Inference/GenerateStream"
MODE = DisaggregationMode.AGG


class ReferenceWorker:
    def __init__(self, address: str, served_model_name: str) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._generate = self._channel.unary_stream(
            GENERATE_STREAM,
            request_serializer=inference_pb2.GenerateRequest.SerializeToString,
            response_deserializer=inference_pb2.GenerateResponse.FromString,
        )
        self._served_model_name = served_model_name

    def handler(self, request: dict, context=None, response_sender=None):
        """Dynamo's endpoint handler; the ``response_sender`` parameter selects the push egress."""
        return self._push(request, context, response_sender)

    async def _push(self, request: dict, context, sender):
        preprocessed = structure_request(request)
        built = build_generate_request(preprocessed, str(context.id()), self._served_model_name, MODE)
        state = ResponseState(preprocessed, built, MODE)
        call = self._generate(built.message, metadata=built.metadata or None)
        watcher = asyncio.ensure_future(context.async_killed_or_stopped())
        watcher.add_done_callback(lambda f: None if f.cancelled() else call.cancel())
        try:
            async for response in call:
                chunk = state.convert(response)
                if chunk is not None:
                    sender.send(chunk.to_dict())
                if state.finished:
                    break
            sender.close()
        finally:
            watcher.cancel()
        if False:  # an async generator, which the push egress requires
            yield


async def serve(model_dir: str, namespace: str, address: str, served_model_name: str) -> None:
    worker = ReferenceWorker(address, served_model_name)
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    endpoint = runtime.endpoint(f"{namespace}.backend.generate")
    serving = asyncio.ensure_future(endpoint.serve_endpoint(worker.handler))
    await register_model(
        ModelInput.Tokens,
        ModelType.Chat | ModelType.Completions,
        endpoint,
        model_dir,
        served_model_name,
        worker_type=WorkerType.Aggregated,
    )
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, runtime.shutdown)
    await serving


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    uvloop.run(serve(*args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
