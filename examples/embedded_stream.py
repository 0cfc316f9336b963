"""Stream a completion through the embedded Trio API.

Starts the CPU-only mock vLLM server in-process (127.0.0.1, OS-chosen port), opens a sidecar against it
with ``open_sidecar``, streams one request and prints the tokens as they arrive, then the usage::

    python examples/embedded_stream.py [--max-tokens 16] [--prompt 1,2,3,4]

Exit status 0 on success, 1 on any sidecar error (printed).
"""

from __future__ import annotations

import argparse
import sys

import trio
from rich.console import Console
from rich.table import Table

from trio_sidecar import GenerateContext, SidecarConfig, SidecarError, open_sidecar
from trio_sidecar.mock import MockConfig, open_mock_server

# The mock's fast engine args: no modelled latency, a small KV block size.
ENGINE_ARGS = {"block_size": 4, "enable_prefix_caching": False, "speedup_ratio": 0.0}


# A guard so that the demo never hangs: everything below normally takes well under a second.
OVERALL_TIMEOUT = 60.0


async def main(argv: list[str] | None = None) -> int:
    with trio.move_on_after(OVERALL_TIMEOUT) as guard:
        return await _demo(argv)
    assert guard.cancelled_caught
    Console().print(f"[red]error:[/red] the demo did not finish within {OVERALL_TIMEOUT:g}s")
    return 1


async def _demo(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt", default="1,2,3,4", help="comma-separated prompt token ids")
    args = parser.parse_args(argv)
    prompt = [int(t) for t in args.prompt.split(",") if t.strip()]
    console = Console(highlight=False)

    mock_config = MockConfig(listen="127.0.0.1:0", model="mocker-model", engine_args=ENGINE_ARGS)
    async with open_mock_server(mock_config) as mock:
        console.print(f"[bold]mock vLLM[/bold] listening on {mock.address}")
        config = SidecarConfig(grpc_endpoint=mock.address, grpc_connections=2, startup_deadline=30.0)
        try:
            async with open_sidecar(config) as sidecar:
                console.print(
                    f"[bold]sidecar[/bold] started: model [cyan]{sidecar.model.served_model_name}[/cyan], "
                    f"context {sidecar.engine_config.context_length}, "
                    f"KV block size {sidecar.engine_config.kv_cache_block_size}"
                )
                request = {"token_ids": prompt, "stop_conditions": {"max_tokens": args.max_tokens}}
                last = None
                tokens: list[int] = []
                async with sidecar.generate(request, GenerateContext("embedded-1")) as chunks:
                    async for chunk in chunks:
                        tokens.extend(chunk.token_ids)
                        if chunk.text:
                            console.print(chunk.text, end="", style="green")
                        last = chunk
                console.print()
        except SidecarError as exc:
            console.print(f"[red]error:[/red] {exc}")
            return 1

    table = Table(title="completion")
    table.add_column("finish reason")
    table.add_column("prompt tokens", justify="right")
    table.add_column("completion tokens", justify="right")
    table.add_column("total", justify="right")
    usage = last.completion_usage if last is not None else None
    if last is None or usage is None:
        console.print("[red]error:[/red] the stream ended without a terminal chunk")
        return 1
    table.add_row(
        str(last.finish_reason), str(usage.prompt_tokens), str(usage.completion_tokens), str(usage.total_tokens)
    )
    console.print(table)
    console.print(f"token ids: {tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main))
