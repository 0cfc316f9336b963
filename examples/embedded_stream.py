"""Stream a completion of a text prompt through the typed embedded API (docs/embedded.md).

Starts the mock vLLM server in-process on a tiny local model (it tokenizes text like a real server),
streams one completion and prints its text as it arrives, then the finish reason and the usage::

    python examples/embedded_stream.py [--max-tokens 16] [--prompt "Structured concurrency is"]
"""

from __future__ import annotations

import argparse
import tempfile

import trio

from trio_sidecar import SamplingParams, SidecarConfig, open_sidecar
from trio_sidecar.mock import MockConfig, open_mock_server
from trio_sidecar.mock.tiny_model import make_tiny_model


async def main(prompt: str, max_tokens: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mock = MockConfig(listen="127.0.0.1:0", model=str(make_tiny_model(tmp)), engine_args={"speedup_ratio": 0})
        async with open_mock_server(mock) as vllm, open_sidecar(SidecarConfig(grpc_endpoint=vllm.address)) as sidecar:
            async with sidecar.stream(prompt, SamplingParams(max_tokens=max_tokens)) as stream:
                async for delta in stream:
                    print(delta.text, end="", flush=True)
                done = await stream.final()  # (the stream is read already: the completion it ended with)
            print(f"\nfinish_reason={done.finish_reason} {done.usage}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt", default="Structured concurrency is")
    args = parser.parse_args()
    trio.run(main, args.prompt, args.max_tokens)
