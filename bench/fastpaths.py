"""What each fast path buys: an A/B in one process, alternated, with an A/A control (docs/performance.md#fast-paths).

For each fast path the benchmark starts two mocks (``bench/sidecar.py``'s engine arguments, speedup 0):
one as shipped (A) and one with the fast path switched off (B, for the fast paths the mock runs), and
alternates rounds: A = sidecar as shipped against mock A, B = sidecar with the fast path off against mock B.
Each round opens a fresh sidecar (some fast paths are installed per connection), warms it up, then runs
``--requests`` requests of 32 tokens, 64 at a time, through ``submit()`` (the Dynamo bridge's path) and
through ``generate()`` (the Python API's). It prints, per fast path, the median and range over the rounds of
the CPU µs per request of this process (the sidecar) and of the mock (from ``/proc``, all threads), and
what switching the fast path off costs (B / A − 1). The ``none`` row switches nothing off: its spread is the
noise floor of the run.

    python bench/fastpaths.py --rounds 5 --requests 1000 [--only NAME,...]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import runpy
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack

sys.path.insert(0, str(pathlib.Path(__file__).parent))

CONCURRENCY = 64
TOKENS = 32
ENV = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict layouts in every child


# -- the switches: name -> a function that switches the fast path off (in this process) -------------------

_UNDO: list[tuple[object, str, object]] = []


def patch(target: object, name: str, value: object) -> None:
    """``setattr(target, name, value)``, undone by :func:`restore`."""
    _UNDO.append((target, name, target.__dict__[name] if name in vars(target) else None))
    setattr(target, name, value)


def restore() -> None:
    while _UNDO:
        target, name, value = _UNDO.pop()
        setattr(target, name, value)


def _off_hpack() -> None:
    import hpack

    from trio_sidecar.transport import _h2

    patch(_h2, "CachingEncoder", hpack.Encoder)
    patch(_h2, "CachingDecoder", hpack.Decoder)


def _off_open_request_stream() -> None:
    from trio_sidecar.transport import _fast

    patch(_fast, "open_request_stream", lambda h2conn, stream_id, headers: False)


def _off_send_data() -> None:
    from trio_sidecar.transport import _fast

    patch(_fast, "try_send_data", lambda h2conn, stream_id, data, end_stream: False)


def _off_acknowledge() -> None:
    from trio_sidecar.transport import _fast

    patch(_fast, "count_acknowledged", lambda h2conn, stream_id, length: False)


def _off_receive() -> None:
    from trio_sidecar.transport import _fast

    patch(_fast, "accept_plain_data", lambda h2conn, stream_id, length: False)


def _off_plain_headers() -> None:
    from trio_sidecar.transport._protocol import GrpcProtocol

    patch(GrpcProtocol, "fast_headers", False)


def _off_whole_messages() -> None:
    from trio_sidecar.transport import _fast

    patch(_fast, "whole_messages", lambda data, limit: None)


def _off_token_chunk() -> None:
    from trio_sidecar.core import protocol
    from trio_sidecar.core.convert import batch

    def token_chunk(token_ids, text):  # type: ignore[no-untyped-def]
        return protocol.LLMEngineOutput(token_ids=token_ids, text=text)

    patch(protocol, "token_chunk", token_chunk)
    patch(batch, "token_chunk", token_chunk)


def _off_convert_plain() -> None:
    from trio_sidecar.core.convert.response import ResponseState

    patch(ResponseState, "convert_plain", lambda self, data: None)


def _off_framed_tokens() -> None:
    from trio_sidecar.mock import fast, server

    def framed_token_encoder(options):  # type: ignore[no-untyped-def]
        frame = fast.FramedMessages.frame
        return lambda token: frame(fast.token_message(token, options))

    patch(server, "framed_token_encoder", framed_token_encoder)


SWITCHES: dict[str, Callable[[], None]] = {
    "none": lambda: None,
    "hpack_cache": _off_hpack,
    "open_request_stream": _off_open_request_stream,
    "send_data": _off_send_data,
    "acknowledge": _off_acknowledge,
    "plain_data": _off_receive,
    "plain_headers": _off_plain_headers,
    "whole_messages": _off_whole_messages,
    "token_chunk": _off_token_chunk,
    "convert_plain": _off_convert_plain,
    "framed_tokens": _off_framed_tokens,
}


# -- the paired micro A/B: each fast path's own workload, on and off in turn in this process ------------

REQUEST_HEAD = [
    (":method", "POST"),
    (":scheme", "http"),
    (":authority", "127.0.0.1:50051"),
    (":path", "/vllm.Inference/GenerateStream"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
]
RESPONSE_HEAD = [(":status", "200"), ("content-type", "application/grpc")]
TRAILERS = [("grpc-status", "0")]


def transport_requests(n: int) -> None:
    """``n`` calls shaped like a sidecar request over a sans-IO client/server ``GrpcProtocol`` pair (one new
    pair, then: request headers and message; response headers, 32 one-token messages, one DATA frame each
    (as paced by an engine), trailers; window updates), both sides' work."""
    from purerpc.grpclib.config import GRPCConfiguration

    from trio_sidecar.transport._events import MessageReceived
    from trio_sidecar.transport._protocol import GrpcProtocol
    from trio_sidecar.transport._wire import frame_message

    client = GrpcProtocol(GRPCConfiguration(client_side=True))
    server = GrpcProtocol(GRPCConfiguration(client_side=False))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    request = frame_message(b"\n\x05r-123\x12\x10" + bytes(range(16)))
    tokens = [frame_message(b'\x12\x0b\x12\x03 ab\x18\x01"\x02' + bytes((65 + i % 50, 1))) for i in range(TOKENS)]
    for _ in range(n):
        stream_id = client.open_stream(REQUEST_HEAD)
        client.send_message(stream_id, request, True) or client.send_data(stream_id, request, True)
        for event in server.receive_data(client.data_to_send()):
            if type(event) is MessageReceived:
                server.acknowledge(event.stream_id, event.flow_controlled_length)
        server.send_headers(stream_id, RESPONSE_HEAD)
        for token in tokens:
            server.send_message(stream_id, token, False) or server.send_data(stream_id, token, False)
            for event in client.receive_data(server.data_to_send()):
                if type(event) is MessageReceived:
                    client.acknowledge(event.stream_id, event.flow_controlled_length)
        server.send_trailers(stream_id, TRAILERS)
        client.receive_data(server.data_to_send())
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())


def chunk_requests(n: int) -> None:
    """32 one-token chunks per request, as ``ChunkBatch`` builds them for ``generate()``."""
    from trio_sidecar.core.convert import batch

    for _ in range(n):
        for i in range(TOKENS):
            batch.token_chunk([i], "ab")


def _messages() -> list[bytes]:
    from trio_sidecar.mock.fast import token_message
    from trio_sidecar.mock.generation import OutputOptions

    options = OutputOptions(text=True, token_ids=True)
    return [token_message(1000 + i, options) for i in range(TOKENS)]


def convert_requests(n: int) -> None:
    """A request's 32 one-token messages through the ``BatchBuilder`` (aggregated mode)."""
    from sidecar import dynamo_body

    from trio_sidecar.core.config import DisaggregationMode
    from trio_sidecar.core.convert.batch import BatchBuilder
    from trio_sidecar.core.convert.request import build_generate_request
    from trio_sidecar.core.convert.response import ResponseState
    from trio_sidecar.core.protocol import structure_request

    request = structure_request(dynamo_body(TOKENS))
    built = build_generate_request(request, "r", "m", DisaggregationMode.AGG)
    messages = _messages()
    for _ in range(n):
        builder = BatchBuilder(ResponseState(request, built, DisaggregationMode.AGG), decode=False)
        for data in messages:
            builder.add(data, False)


def mock_token_requests(n: int) -> None:
    """The mock's framed per-token messages of ``n`` requests (a token encoder per request, 32 tokens)."""
    from trio_sidecar.mock.fast import framed_token_encoder
    from trio_sidecar.mock.generation import TOKEN_BASE, OutputOptions

    options = OutputOptions(text=True, token_ids=True)
    for r in range(n):
        framed = framed_token_encoder(options)
        for i in range(TOKENS):
            framed(TOKEN_BASE + (r * 7 + i * 13) % 30_000)


WORKLOADS: dict[str, Callable[[int], None]] = {
    "hpack_cache": transport_requests,
    "open_request_stream": transport_requests,
    "send_data": transport_requests,
    "acknowledge": transport_requests,
    "plain_data": transport_requests,
    "plain_headers": transport_requests,
    "whole_messages": transport_requests,
    "token_chunk": chunk_requests,
    "convert_plain": convert_requests,
    "framed_tokens": mock_token_requests,
}


# The one call a small transport fast path changes (or the receive path it is in): timed alone inside the workload (the whole workload's
# noise would swamp it), with the same timing wrapper on both sides.
FOCUS = {"open_request_stream": "open_stream", "acknowledge": "acknowledge", "plain_headers": "receive_data"}


def micro(name: str, workload: Callable[[int], None], rounds: int, requests: int) -> tuple[list[float], list[float]]:
    """Rounds of ``workload`` with ``name`` on (A) and off (B), alternating which goes first; returns the
    CPU µs per request of A and of B (of the focused call only, for the ``FOCUS`` ones), round by round."""
    from trio_sidecar.transport._protocol import GrpcProtocol

    a: list[float] = []
    b: list[float] = []
    spent = [0.0]
    focus = FOCUS.get(name)
    if focus is not None:
        inner = getattr(GrpcProtocol, focus)

        def timed(self, *args):  # type: ignore[no-untyped-def]
            t0 = time.thread_time()
            try:
                return inner(self, *args)
            finally:
                spent[0] += time.thread_time() - t0

        patch(GrpcProtocol, focus, timed)
        kept = list(_UNDO)
        _UNDO.clear()
    workload(requests // 4)  # warm-up
    try:
        for n in range(rounds):
            for side in ("A", "B") if n % 2 == 0 else ("B", "A"):
                if side == "B":
                    SWITCHES[name]()
                try:
                    cpu0, spent[0] = time.process_time(), 0.0
                    workload(requests)
                    cpu = spent[0] if focus is not None else time.process_time() - cpu0
                finally:
                    restore()
                (a if side == "A" else b).append(1e6 * cpu / requests)
    finally:
        if focus is not None:
            _UNDO.extend(kept)
            restore()
    return a, b


def micro_report(names: list[str], rounds: int, requests: int) -> None:
    for name in names:
        if name == "none":
            continue
        workload = WORKLOADS[name]
        a, b = micro(name, workload, rounds, requests)
        if name in FOCUS:  # the A/A control: the same workload and focus
            FOCUS["none"] = FOCUS[name]
        aa_a, aa_b = micro("none", workload, rounds, requests)
        FOCUS.pop("none", None)
        saved = sorted(y - x for x, y in zip(a, b, strict=True))
        control = sorted(y - x for x, y in zip(aa_a, aa_b, strict=True))
        print(
            f"{name:20} {workload.__name__:20} on {statistics.median(a):8.1f}  off {statistics.median(b):8.1f} "
            f"µs/request; saves {statistics.median(saved):+7.1f} [{saved[0]:+.1f}, {saved[-1]:+.1f}]; "
            f"A/A {statistics.median(control):+.1f} [{control[0]:+.1f}, {control[-1]:+.1f}]",
            flush=True,
        )


# -- the mock, with or without a fast path ---------------------------------------------------------------


def serve_mock(switch: str, argv: list[str]) -> None:
    """``python -m trio_sidecar.mock ARGV`` with ``switch`` off (the child side of :func:`start_mock`)."""
    SWITCHES[switch]()
    sys.argv = ["trio_sidecar.mock", *argv]
    runpy.run_module("trio_sidecar.mock", run_name="__main__")


def start_mock(switch: str) -> tuple[subprocess.Popen, str]:
    import json

    engine_args = {
        "block_size": 16,
        "enable_prefix_caching": False,
        "num_gpu_blocks": 1_000_000,
        "max_num_seqs": CONCURRENCY,
        "max_num_batched_tokens": 1_000_000,
        "speedup_ratio": 0.0,
    }
    argv = ["--listen", "127.0.0.1:0", "--max-concurrent-requests", str(2 * CONCURRENCY)]
    argv += ["--extra-engine-args", json.dumps(engine_args), "--log-level", "warning"]
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve-mock", switch, "--", *argv], stdout=subprocess.PIPE, text=True, env=ENV
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    if match is None:
        process.kill()
        raise SystemExit(f"the mock did not start: {line!r}")
    return process, match.group(1)


def process_cpu(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` so far (``/proc/PID/task/*/schedstat``, nanoseconds)."""
    total = 0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


# -- one round -------------------------------------------------------------------------------------------


async def one_round(address: str, mock_pid: int, requests: int) -> dict[str, float]:
    import trio
    from sidecar import dynamo_body, run_requests

    from trio_sidecar import GenerateContext, SidecarConfig, open_sidecar

    out: dict[str, float] = {}
    config = SidecarConfig(grpc_endpoint=address, grpc_connections=8, startup_deadline=30.0, health_prober=False)
    async with open_sidecar(config) as sidecar:

        class Sink:  # what the Dynamo bridge's sink does: the tokens' dict (see bench/sidecar.py)
            __slots__ = ("done", "seen")

            def __init__(self) -> None:
                self.seen = 0
                self.done = trio.Event()

            def chunk(self, chunk) -> None:  # type: ignore[no-untyped-def]
                self.seen += len(chunk.token_ids)
                chunk.to_dict()

            def tokens(self, token_ids, text) -> None:  # type: ignore[no-untyped-def]
                self.seen += len(token_ids)
                _ = {"token_ids": token_ids, "index": 0, "text": text}

            def end(self, final, error) -> None:  # type: ignore[no-untyped-def]
                if final is not None:
                    self.seen += len(final.token_ids)
                    final.to_dict()
                self.done.set()

        async def submitted(i: int) -> int:
            sink = Sink()
            sidecar.submit(dynamo_body(TOKENS), GenerateContext(f"u-{i}"), sink)
            await sink.done.wait()
            return sink.seen

        async def generated(i: int) -> int:
            tokens = 0
            async with sidecar.generate(dynamo_body(TOKENS), GenerateContext(f"g-{i}")) as chunks:
                async for chunk in chunks:
                    tokens += len(chunk.token_ids)
                    chunk.to_dict()
            return tokens

        await run_requests(100, CONCURRENCY, submitted)  # warm-up (connections, caches)
        for label, fn in (("submit", submitted), ("generate", generated)):
            mock0 = process_cpu(mock_pid)
            _, cpu, tokens = await run_requests(requests, CONCURRENCY, fn)
            mock_cpu = process_cpu(mock_pid) - mock0
            assert tokens == requests * TOKENS, (label, tokens)
            out[f"{label} sidecar"] = 1e6 * cpu / requests
            out[f"{label} mock"] = 1e6 * mock_cpu / requests
    return out


def run_switch(switch: str, rounds: int, requests: int, verbose: bool = False) -> dict[str, list[float]]:
    """Rounds alternating A (as shipped) and B (``switch`` off), each in a child process of its own (the
    switches monkeypatch; a child forgets them); returns each measure's B/A − 1 per round pair."""
    costs: dict[str, list[float]] = {}
    for n in range(rounds):
        order = ("A", "B") if n % 2 == 0 else ("B", "A")
        result: dict[str, dict[str, float]] = {}
        for side in order:  # a fresh mock per round and side: a long-lived mock drifts on its own
            with ExitStack() as stack:
                mock, address = start_mock("none" if side == "A" else switch)
                stack.callback(stop, mock)
                result[side] = child_round("none" if side == "A" else switch, address, mock.pid, requests)
        if verbose:
            print(f"  round {n}: A {result['A']}  B {result['B']}", flush=True)
        for key, value in result["A"].items():
            costs.setdefault(key, []).append(result["B"][key] / value - 1)
    return costs


def child_round(switch: str, address: str, mock_pid: int, requests: int) -> dict[str, float]:
    """One round with ``switch`` off, in a child process (the switches monkeypatch; a child forgets them)."""
    import json

    line = (
        subprocess.run(
            [sys.executable, __file__, "--child", switch, address, str(mock_pid), str(requests)],
            check=True,
            env=ENV,
            stdout=subprocess.PIPE,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    return json.loads(line)  # type: ignore[no-any-return]


def stop(process: subprocess.Popen) -> None:
    """SIGTERM a mock started here (by PID), SIGKILL it after 10 s."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-mock":
        serve_mock(sys.argv[2], sys.argv[4:])
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        import json

        import trio

        switch, address, pid, requests = sys.argv[2:6]
        SWITCHES[switch]()
        print(json.dumps(trio.run(one_round, address, int(pid), int(requests))))
        return 0
    parser = argparse.ArgumentParser(description="what each fast path buys (A/B, alternated, A/A control)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--e2e", action="store_true", help="whole sidecar + mock rounds instead of the micro A/B")
    parser.add_argument("--verbose", action="store_true", help="print every round's values")
    parser.add_argument("--only", default="", help="comma-separated switch names (default: all)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(SWITCHES)
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds x {args.requests} requests x {TOKENS} tokens")
    if not args.e2e:
        micro_report(names, args.rounds, args.requests)
        return 0
    for name in names:
        started = time.perf_counter()
        costs = run_switch(name, args.rounds, args.requests, args.verbose)
        cells = []
        for key, values in costs.items():
            ordered = sorted(values)
            cells.append(
                f"{key} {100 * statistics.median(ordered):+.1f}% [{100 * ordered[0]:+.1f}, {100 * ordered[-1]:+.1f}]"
            )
        print(f"{name:20} off costs: " + "; ".join(cells) + f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
