"""A server in its own process, for peer-death tests: ``python peer_process.py ours|aio``.

Prints the bound port on one line, then serves the echo service until killed.
"""

from __future__ import annotations

import asyncio
import sys

import trio
from transport_peers import Recorder, TrioEcho


def main(kind: str) -> None:
    recorder = Recorder()
    if kind == "ours":
        from trio_sidecar.transport import serve_grpc

        async def serve() -> None:
            async with trio.open_nursery() as nursery:
                server = await nursery.start(serve_grpc, [TrioEcho(recorder)])
                print(server.port, flush=True)

        trio.run(serve)
    else:
        import grpc
        from transport_peers import _aio_handlers, aio_options

        async def serve() -> None:
            server = grpc.aio.server(options=aio_options())
            server.add_generic_rpc_handlers(_aio_handlers(recorder))
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            print(port, flush=True)
            await server.wait_for_termination()

        asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1])
