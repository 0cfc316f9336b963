"""Cancel a stream after 3 tokens and watch the mock's work go away.

Starts a deliberately slow mock vLLM in-process, streams a 10,000-token request through ``open_sidecar``,
calls ``ctx.stop()`` after the third token, and prints the mock's counters (in-flight requests, running,
waiting, Abort calls) until they reach zero::

    python examples/cancel_midstream.py

Exit status 0 when the mock drained within 5 s, 1 otherwise.
"""

from __future__ import annotations

import sys

import trio
from rich.console import Console
from rich.table import Table

from trio_sidecar import GenerateContext, SidecarConfig, SidecarError, open_sidecar
from trio_sidecar.mock import MockConfig, open_mock_server

# speedup_ratio 0.1: every scheduler pass takes ~10x the modelled time, so the request is still running
# when it is cancelled.
ENGINE_ARGS = {"block_size": 4, "enable_prefix_caching": False, "speedup_ratio": 0.1}
CANCEL_AFTER = 3


def counters(mock) -> tuple[int, int, int, int]:
    metrics = mock.metrics(0)
    return (mock.active_request_count(), metrics.running_requests, metrics.waiting_requests, len(mock.abort_calls))


async def main() -> int:
    console = Console(highlight=False)
    table = Table(title="mock counters")
    for column in ("moment", "in flight", "running", "waiting", "Abort calls"):
        table.add_column(column, justify="right" if column != "moment" else "left")

    mock_config = MockConfig(listen="127.0.0.1:0", model="mocker-model", engine_args=ENGINE_ARGS)
    async with open_mock_server(mock_config) as mock:
        config = SidecarConfig(grpc_endpoint=mock.address, grpc_connections=1, startup_deadline=30.0)
        try:
            async with open_sidecar(config) as sidecar:
                ctx = GenerateContext("cancel-demo")
                request = {"token_ids": [1, 2, 3, 4], "stop_conditions": {"max_tokens": 10000}}
                received = 0
                async with sidecar.generate(request, ctx) as chunks:
                    async for chunk in chunks:
                        if chunk.finish_reason is not None:
                            usage = chunk.completion_usage
                            console.print(
                                f"terminal chunk: finish_reason [bold]{chunk.finish_reason}[/bold], "
                                f"usage {usage.prompt_tokens}+{usage.completion_tokens}"
                            )
                            continue
                        received += len(chunk.token_ids)
                        console.print(f"token {received}: {chunk.token_ids[0]}")
                        if received == CANCEL_AFTER:
                            table.add_row("before stop()", *map(str, counters(mock)))
                            ctx.stop()
                table.add_row("after the stream", *map(str, counters(mock)))
                drained = False
                with trio.move_on_after(5):
                    while counters(mock)[:3] != (0, 0, 0) or not mock.abort_calls:  # noqa: ASYNC110 - polls the mock's counters
                        await trio.sleep(0.01)
                    drained = True
                table.add_row("drained" if drained else "after 5 s", *map(str, counters(mock)))
        except SidecarError as exc:
            console.print(f"[red]error:[/red] {exc}")
            return 1
    console.print(table)
    if not drained:
        console.print("[red]the mock did not drain within 5 s[/red]")
        return 1
    console.print("[green]the mock's work went to zero[/green]")
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main))
