"""Transport benchmark (docs/reference/transport.md#benchmark-method): our transport vs raw purerpc 0.8.0 vs grpc.aio.

    python bench/transport.py            # full run (about 2 minutes on 2 cores)
    python bench/transport.py --quick    # shorter workloads

Every cell runs the client and the server in two separate processes over 127.0.0.1. Workloads (as in
docs/reference/transport.md#benchmark-method): unary = one client with one call outstanding for a fixed time; 1 stream = one
server stream of N small messages; 100 streams = 100 concurrent streams of M messages on one connection.
Messages are small (a few int fields). CPU µs per message = (client CPU + server CPU) / messages, from the
processes' own CPU times. Ratios are against grpc.aio → grpc.aio, plus our transport against raw purerpc.

Targets: streaming ≥ 1.0× grpc.aio; unary ≥ 0.75× grpc.aio (later relaxed to ≥ 0.7×);
our fixes cost ≤ 10% vs raw purerpc.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import psutil

IMPLS = ("ours", "purerpc", "aio")
PAIRS = (("ours", "ours"), ("purerpc", "purerpc"), ("aio", "aio"), ("ours", "aio"), ("aio", "ours"))
LABEL = {"ours": "trio-sidecar", "purerpc": "purerpc-trio", "aio": "grpc.aio"}


# -- the service (same behaviour in every implementation) ----------------------------------------------


def _messages():
    from trio_sidecar._proto.vllm import inference_pb2 as pb

    response = pb.GenerateResponse(outputs=pb.SequenceOutput(index=1, num_tokens=1, token_ids=[42]))
    return pb, response


def serve(impl: str) -> None:
    """Run a server on 127.0.0.1:0, print its port, serve until killed."""
    pb, response = _messages()
    if impl == "aio":
        import asyncio

        import grpc

        async def generate(request, context):
            return response

        async def generate_stream(request, context):
            for _ in range(request.truncate_prompt_tokens):
                yield response

        async def main() -> None:
            server = grpc.aio.server()
            server.add_generic_rpc_handlers(
                (
                    grpc.method_handlers_generic_handler(
                        "vllm.Inference",
                        {
                            "Generate": grpc.unary_unary_rpc_method_handler(
                                generate,
                                request_deserializer=pb.GenerateRequest.FromString,
                                response_serializer=pb.GenerateResponse.SerializeToString,
                            ),
                            "GenerateStream": grpc.unary_stream_rpc_method_handler(
                                generate_stream,
                                request_deserializer=pb.GenerateRequest.FromString,
                                response_serializer=pb.GenerateResponse.SerializeToString,
                            ),
                        },
                    ),
                )
            )
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            print(port, flush=True)
            await server.wait_for_termination()

        asyncio.run(main())
        return

    import trio

    from trio_sidecar._proto.vllm import inference_grpc

    if impl == "ours":
        from trio_sidecar.transport import serve_grpc

        class Servicer(inference_grpc.InferenceServicer):
            async def Generate(self, request, context):  # noqa: N802
                return response

            async def GenerateStream(self, request, context):  # noqa: N802
                for _ in range(request.truncate_prompt_tokens):
                    yield response

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                server = await nursery.start(serve_grpc, [Servicer()])
                print(server.port, flush=True)

        trio.run(main)
        return

    # Raw purerpc: its own ConnectionHandler behind a 127.0.0.1 listener (docs/reference/transport.md#why-not-purerpcs-own-io-layer; the stock
    # Server binds every interface).
    import anyio
    import purerpc.server

    class PurerpcServicer(inference_grpc.InferenceServicer):
        async def Generate(self, message):  # noqa: N802
            return response

        async def GenerateStream(self, message):  # noqa: N802
            for _ in range(message.truncate_prompt_tokens):
                yield response

    async def main() -> None:
        service = PurerpcServicer().service
        server = purerpc.Server(port=0)
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        print(listener.extra(anyio.abc.SocketAttribute.local_port), flush=True)
        await listener.serve(purerpc.server.ConnectionHandler({service.name: service}, server))

    trio.run(main)


# -- clients -------------------------------------------------------------------------------------------


def client(impl: str, port: int, workload: str, amount: float) -> dict:
    """Run one workload; returns messages and wall seconds (CPU is measured by the parent)."""
    pb, _ = _messages()
    unary_request = pb.GenerateRequest(request_id="bench")

    if impl == "aio":
        import asyncio

        import grpc

        async def main() -> tuple[int, float, float]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                unary = channel.unary_unary(
                    "/vllm.Inference/Generate",
                    request_serializer=pb.GenerateRequest.SerializeToString,
                    response_deserializer=pb.GenerateResponse.FromString,
                )
                stream = channel.unary_stream(
                    "/vllm.Inference/GenerateStream",
                    request_serializer=pb.GenerateRequest.SerializeToString,
                    response_deserializer=pb.GenerateResponse.FromString,
                )
                await unary(unary_request)
                start, cpu0 = time.perf_counter(), _cpu_self()
                if workload == "unary":
                    count = 0
                    while time.perf_counter() - start < amount:
                        await unary(unary_request)
                        count += 1
                    return count, time.perf_counter() - start, _cpu_self() - cpu0

                async def one(n: int) -> int:
                    got = 0
                    async for _ in stream(pb.GenerateRequest(truncate_prompt_tokens=n)):
                        got += 1
                    return got

                streams = 1 if workload == "stream1" else 100
                counts = await asyncio.gather(*(one(int(amount)) for _ in range(streams)))
                return sum(counts), time.perf_counter() - start, _cpu_self() - cpu0

        count, wall, cpu = asyncio.run(main())
        return {"messages": count, "wall": wall, "cpu": cpu}

    import trio

    if impl == "ours":
        from trio_sidecar.transport import open_channel

        async def main() -> tuple[int, float, float]:
            async with open_channel("127.0.0.1", port) as channel:
                await channel.unary_unary("/vllm.Inference/Generate", unary_request, pb.GenerateResponse)
                start, cpu0 = time.perf_counter(), _cpu_self()
                if workload == "unary":
                    count = 0
                    while time.perf_counter() - start < amount:
                        await channel.unary_unary("/vllm.Inference/Generate", unary_request, pb.GenerateResponse)
                        count += 1
                    return count, time.perf_counter() - start, _cpu_self() - cpu0
                total = 0

                async def one(n: int) -> None:
                    nonlocal total
                    async with channel.unary_stream(
                        "/vllm.Inference/GenerateStream",
                        pb.GenerateRequest(truncate_prompt_tokens=n),
                        pb.GenerateResponse,
                    ) as stream:
                        async for _ in stream:
                            total += 1

                async with trio.open_nursery() as nursery:
                    for _ in range(1 if workload == "stream1" else 100):
                        nursery.start_soon(one, int(amount))
                return total, time.perf_counter() - start, _cpu_self() - cpu0

    else:
        import purerpc

        from trio_sidecar._proto.vllm import inference_grpc

        async def main() -> tuple[int, float, float]:
            async with purerpc.insecure_channel("127.0.0.1", port) as channel:
                stub = inference_grpc.InferenceStub(channel)
                await stub.Generate(unary_request)
                start, cpu0 = time.perf_counter(), _cpu_self()
                if workload == "unary":
                    count = 0
                    while time.perf_counter() - start < amount:
                        await stub.Generate(unary_request)
                        count += 1
                    return count, time.perf_counter() - start, _cpu_self() - cpu0
                total = 0

                async def one(n: int) -> None:
                    nonlocal total
                    async for _ in stub.GenerateStream(pb.GenerateRequest(truncate_prompt_tokens=n)):
                        total += 1

                async with trio.open_nursery() as nursery:
                    for _ in range(1 if workload == "stream1" else 100):
                        nursery.start_soon(one, int(amount))
                return total, time.perf_counter() - start, _cpu_self() - cpu0

    count, wall, cpu = trio.run(main)
    return {"messages": count, "wall": wall, "cpu": cpu}


# -- orchestration ---------------------------------------------------------------------------------------


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def run_cell(client_impl: str, server_impl: str, workload: str, amount: float) -> dict:
    server = subprocess.Popen([sys.executable, __file__, "--serve", server_impl], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        server_proc = psutil.Process(server.pid)
        time.sleep(0.2)
        server_cpu = _cpu(server_proc)
        child = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--client",
                client_impl,
                "--port",
                str(port),
                "--workload",
                workload,
                "--amount",
                str(amount),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            output, _ = child.communicate(timeout=600)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        if child.returncode != 0:
            raise RuntimeError(f"client {client_impl}->{server_impl} {workload} failed")
        result = json.loads(output)
        client_cpu = result["cpu"]  # measured by the client around the workload only
        server_cpu = _cpu(server_proc) - server_cpu
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
    messages = result["messages"]
    return {
        "rate": messages / result["wall"],
        "client_us": client_cpu / messages * 1e6,
        "server_us": server_cpu / messages * 1e6,
    }


def _cpu_self() -> float:
    times = os.times()
    return times.user + times.system


def _client_main(args: argparse.Namespace) -> None:
    print(json.dumps(client(args.client, args.port, args.workload, args.amount)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--client", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--amount", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="shorter workloads (noisier)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell; the median is reported")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    if args.client:
        _client_main(args)
        return

    # Terminating the orchestrator still kills its server/client children (run_cell's finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    workloads = {
        "unary": 1.5 if args.quick else 3.0,  # seconds
        "stream1": 20_000 if args.quick else 50_000,  # messages
        "stream100": 200 if args.quick else 1_000,  # messages per stream
    }
    results: dict[tuple[str, str, str], dict] = {}
    for client_impl, server_impl in PAIRS:
        for workload, amount in workloads.items():
            runs = [run_cell(client_impl, server_impl, workload, amount) for _ in range(args.repeat)]
            cell = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            results[client_impl, server_impl, workload] = cell
            print(
                f"  {LABEL[client_impl]:>12} -> {LABEL[server_impl]:<12} {workload:<9} "
                f"{cell['rate']:>9,.0f}/s  {cell['client_us'] + cell['server_us']:6.0f} µs",
                file=sys.stderr,
            )
    print_table(results)


def print_table(results: dict) -> None:
    base = {w: results["aio", "aio", w]["rate"] for w in ("unary", "stream1", "stream100")}
    raw = {w: results["purerpc", "purerpc", w]["rate"] for w in ("unary", "stream1", "stream100")}
    print()
    print(
        "| client → server | unary RPC/s (×grpc.aio) | CPU µs/RPC | 1 stream msg/s (×grpc.aio) | CPU µs/msg "
        "| 100 streams msg/s (×grpc.aio) | CPU µs/msg |"
    )
    print("|---|---|---|---|---|---|---|")
    for client_impl, server_impl in PAIRS:
        cells = []
        for workload in ("unary", "stream1", "stream100"):
            cell = results[client_impl, server_impl, workload]
            cpu = cell["client_us"] + cell["server_us"]
            cells.append(f"{cell['rate']:,.0f} ({cell['rate'] / base[workload]:.2f}×)")
            cells.append(f"{cpu:.0f} ({cell['client_us']:.0f}+{cell['server_us']:.0f})")
        print(f"| {LABEL[client_impl]} → {LABEL[server_impl]} | " + " | ".join(cells) + " |")
    print()
    ours = {w: results["ours", "ours", w]["rate"] for w in ("unary", "stream1", "stream100")}
    print(
        "trio-sidecar → trio-sidecar vs raw purerpc → purerpc: "
        + ", ".join(f"{w} {ours[w] / raw[w]:.2f}×" for w in ("unary", "stream1", "stream100"))
    )
    base_cpu = {w: results["aio", "aio", w]["client_us"] + results["aio", "aio", w]["server_us"] for w in base}
    ours_cpu = {w: results["ours", "ours", w]["client_us"] + results["ours", "ours", w]["server_us"] for w in base}
    print(
        "CPU per message, trio-sidecar → trio-sidecar vs grpc.aio → grpc.aio (lower is better): "
        + ", ".join(f"{w} {ours_cpu[w] / base_cpu[w]:.2f}×" for w in ("unary", "stream1", "stream100"))
    )
    checks = [
        ("unary ≥ 0.75× grpc.aio", ours["unary"] / base["unary"] >= 0.75),
        ("1 stream ≥ 1.0× grpc.aio", ours["stream1"] / base["stream1"] >= 1.0),
        ("100 streams ≥ 1.0× grpc.aio", ours["stream100"] / base["stream100"] >= 1.0),
        ("fixes cost ≤ 10% vs raw purerpc", all(ours[w] / raw[w] >= 0.9 for w in raw)),
    ]
    print("targets: " + "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in checks))


if __name__ == "__main__":
    main()
