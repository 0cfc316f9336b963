"""Disaggregated prefill → decode with an image, through two embedded sidecars.

Starts two mock vLLM servers in-process (one emulating a prefill engine, one a decode engine, both with
``--supports-multimodal``), opens a prefill-mode and a decode-mode sidecar, and sends one request whose
prompt holds an image placeholder (token 31999) and whose image is a ``data:`` URI:

1. the prefill sidecar forwards the image as a ``MediaItem``, asks for the expanded prompt ids and returns
   the opaque KV handoff (``disaggregated_params``) carrying them;
2. the decode sidecar forwards the handoff verbatim (``remote_port`` as a decimal string), sends no media and
   the expanded prompt ids, and streams the completion.

    python examples/disaggregated.py
"""

from __future__ import annotations

import base64
import json
import sys

import trio
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from trio_sidecar import GenerateContext, SidecarConfig, SidecarError, open_sidecar
from trio_sidecar.mock import MockConfig, open_mock_server

ENGINE_ARGS = {"block_size": 4, "enable_prefix_caching": False, "speedup_ratio": 0.0}
IMAGE_TOKEN = 31999
HANDOFF_KEY = "_dynamo_sidecar_multimodal_prompt_token_ids"
# A 1x1 transparent PNG; the mock never decodes images.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
DATA_URI = "data:image/png;base64," + base64.b64encode(PNG).decode()


def mock_config(mode: str) -> MockConfig:
    return MockConfig(
        listen="127.0.0.1:0",
        model="mocker-model",
        disaggregation_mode=mode,
        engine_args=ENGINE_ARGS,
        supports_multimodal=True,
    )


def sidecar_config(address: str, mode: str) -> SidecarConfig:
    return SidecarConfig(grpc_endpoint=address, disaggregation_mode=mode, grpc_connections=1, startup_deadline=30.0)


async def main() -> int:
    console = Console(highlight=False)
    request = {
        "token_ids": [1, 2, IMAGE_TOKEN, 3, 4],
        "stop_conditions": {"max_tokens": 6},
        "multi_modal_data": {"image_url": [{"Url": DATA_URI}]},
        "extra_args": {"mm_hashes": ["0123456789abcdef"]},
    }
    try:
        async with (
            open_mock_server(mock_config("prefill")) as prefill_mock,
            open_mock_server(mock_config("decode")) as decode_mock,
        ):
            async with (
                open_sidecar(sidecar_config(prefill_mock.address, "prefill")) as prefill,
                open_sidecar(sidecar_config(decode_mock.address, "decode")) as decode,
            ):
                ctx = GenerateContext("disagg-1")
                async with prefill.generate(request, ctx) as chunks:
                    prefill_chunks = [chunk async for chunk in chunks]
                handoff = prefill_chunks[-1].disaggregated_params or {}
                shown = {k: (f"[{len(v)} ids]" if k == HANDOFF_KEY else v) for k, v in handoff.items()}
                console.print(Panel(json.dumps(shown, indent=2), title="prefill → decode handoff"))

                decode_request = dict(request, prefill_result={"disaggregated_params": handoff})
                tokens: list[int] = []
                last = None
                async with decode.generate(decode_request, GenerateContext("disagg-1")) as chunks:
                    async for chunk in chunks:
                        tokens.extend(chunk.token_ids)
                        last = chunk
                [(_rpc, prefill_wire, _md, _peer)] = prefill_mock.recorded_requests
                [(_rpc, decode_wire, _md, _peer)] = decode_mock.recorded_requests
    except SidecarError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1

    table = Table(title="what each engine received")
    table.add_column("engine")
    table.add_column("prompt ids", justify="right")
    table.add_column("media")
    table.add_column("remote_port")
    media = prefill_wire.media[0]
    table.add_row(
        "prefill",
        str(len(prefill_wire.token_ids.ids)),
        f"{media.WhichOneof('source')} ({len(media.data_uri)} chars), uuid {media.uuid[:16]}…",
        "—",
    )
    port = decode_wire.kv.kv_transfer_params["remote_port"]
    table.add_row("decode", str(len(decode_wire.token_ids.ids)), str(len(decode_wire.media)), repr(port))
    console.print(table)
    if last is None or last.completion_usage is None:
        console.print("[red]error:[/red] the decode stream ended without a terminal chunk")
        return 1
    usage = last.completion_usage
    console.print(
        f"decode tokens {tokens} → finish_reason [bold]{last.finish_reason}[/bold], "
        f"usage {usage.prompt_tokens}+{usage.completion_tokens}={usage.total_tokens}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main))
