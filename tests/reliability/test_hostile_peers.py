"""Hostile peers: a peer cannot exhaust ``trio-sidecar mock`` (or anything ``serve_grpc`` serves).

The server is a real ``trio-sidecar mock`` process on 127.0.0.1 (killed by PID); the peers are raw sockets
speaking HTTP/2 through h2. Memory is the server process's, read from /proc and psutil. Each scenario and
its bound is listed in docs/reliability.md.
"""

from __future__ import annotations

import json
import zlib

import h2.events
import pytest
import trio
from hostile_peers import (
    DATA,
    EMPTY_SETTINGS,
    FRAME_SIZE_ERROR,
    PING_FRAME,
    PREFACE,
    SETTINGS_ACK,
    H2Peer,
    frame_header,
    goaway_codes,
    peak_rss_bytes,
    raw_connect,
    read_until_closed,
    rss_bytes,
)
from reliability_fakes import FAST_ENGINE_ARGS, MockProcess

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import inference_pb2 as pb

MIB = 1024 * 1024
GENERATE = "/vllm.Inference/Generate"
GENERATE_STREAM = "/vllm.Inference/GenerateStream"
WATCH = "/grpc.health.v1.Health/Watch"
RESOURCE_EXHAUSTED = "8"


async def start_mock(tmp_path, *flags: str, engine_args: dict | None = None) -> MockProcess:
    args = ["--extra-engine-args", json.dumps(engine_args or FAST_ENGINE_ARGS), "--log-level", "debug", *flags]
    mock = MockProcess(args, tmp_path / "mock.log")
    await mock.start()
    return mock


def log_text(tmp_path) -> str:
    return (tmp_path / "mock.log").read_text(errors="replace")


def generate_request(max_tokens: int, request_id: str = "r") -> bytes:
    request = pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=[1, 2, 3, 4]),
        stopping=pb.StoppingCriteria(max_new_tokens=max_tokens),
        response=pb.ResponseOptions(output_token_ids=True),
    )
    request.stopping.ignore_eos = True
    return request.SerializeToString()


# --- handshake and idle timeouts ---------------------------------------------------------------------------


async def test_a_connection_that_never_handshakes_is_closed_after_the_handshake_timeout(tmp_path):
    mock = await start_mock(tmp_path, "--handshake-timeout", "0.5")
    try:
        with trio.fail_after(30):
            silent = await raw_connect(mock.port)
            preface_only = await raw_connect(mock.port)
            await preface_only.send_all(PREFACE)  # the preface, but never SETTINGS
            began = trio.current_time()
            async with silent, preface_only:
                await read_until_closed(silent)
                await read_until_closed(preface_only)
            elapsed = trio.current_time() - began
        print(f"handshake timeout 0.5 s: both closed after {elapsed:.2f} s")
        assert 0.4 <= elapsed < 10, elapsed
        # A client that did handshake is still served after the handshake timeout.
        peer = await H2Peer.connect(mock.port)
        try:
            with trio.fail_after(30):
                await peer.handshake()
                await trio.sleep(1.0)
                peer.h2.ping(b"stillok!")
                await peer.flush()
                await peer.wait_for(lambda: any(isinstance(e, h2.events.PingAcknowledged) for e in peer.events))
        finally:
            await peer.aclose()
    finally:
        await mock.aclose()


async def test_an_idle_connection_gets_goaway_and_is_closed_but_an_open_stream_keeps_it(tmp_path):
    idle = 1.0
    mock = await start_mock(tmp_path, "--idle-timeout", str(idle))
    try:
        with trio.fail_after(60):
            quiet = await H2Peer.connect(mock.port)
            busy = await H2Peer.connect(mock.port)
            async with quiet.stream, busy.stream:
                await quiet.handshake()
                await busy.handshake()
                began = trio.current_time()
                watch = busy.open_call(WATCH, health_pb2.HealthCheckRequest(service="").SerializeToString())
                await busy.flush()
                # The quiet one: GOAWAY (NO_ERROR), then the socket closes.
                while await quiet.read_once():
                    pass
                elapsed = trio.current_time() - began
                goaway = quiet.goaway()
                assert goaway is not None and goaway.error_code == 0, quiet.events
                print(f"idle timeout {idle} s: GOAWAY and close after {elapsed:.2f} s")
                assert idle * 0.9 <= elapsed < idle + 10, elapsed
                # The busy one has a stream open for 3 idle periods: still served.
                with trio.move_on_after(3 * idle):
                    while await busy.read_once():
                        pass
                assert not busy.closed and busy.goaway() is None
                # Its stream ends: after one idle period it gets its GOAWAY too.
                busy.h2.reset_stream(watch)
                await busy.flush()
                ended = trio.current_time()
                while await busy.read_once():
                    pass
                assert busy.goaway() is not None
                assert idle * 0.9 <= trio.current_time() - ended < idle + 10, (busy.events, log_text(tmp_path)[-3000:])
    finally:
        await mock.aclose()


# --- connection cap ---------------------------------------------------------------------------------------


async def test_the_connection_cap_turns_away_extra_connections_with_one_log_line(tmp_path):
    cap = 4
    mock = await start_mock(tmp_path, "--max-connections", str(cap))
    try:
        with trio.fail_after(60):
            held = [await H2Peer.connect(mock.port) for _ in range(cap)]
            for peer in held:
                await peer.handshake()
            refused = 0
            for _ in range(50):
                extra = await raw_connect(mock.port)
                async with extra:
                    await extra.send_all(PREFACE + EMPTY_SETTINGS)
                    frames = await read_until_closed(extra)  # closed at once, nothing served
                    assert frames == []
                    refused += 1
            assert refused == 50
            lines = [line for line in log_text(tmp_path).splitlines() if "connection limit reached" in line]
            assert len(lines) == 1, lines
            assert f"max_connections={cap}" in lines[0]
            # Below the cap again: a new connection is served.
            await held.pop().aclose()
            while True:
                peer = await H2Peer.connect(mock.port)
                try:
                    try:
                        await peer.handshake()
                    except AssertionError:
                        await trio.sleep(0.05)  # the server has not seen the close yet
                        continue
                    break
                finally:
                    await peer.aclose()
            for peer in held:
                await peer.aclose()
    finally:
        await mock.aclose()


# --- control-frame floods ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "flood_frame"), [("PING", PING_FRAME), ("SETTINGS", EMPTY_SETTINGS)])
async def test_a_control_frame_flood_whose_acks_are_never_read_ends_in_enhance_your_calm(tmp_path, name, flood_frame):
    mock = await start_mock(tmp_path)
    try:
        pid = mock.process.pid
        with trio.fail_after(180):
            stream = await raw_connect(mock.port, receive_buffer=4096)
            async with stream:
                await stream.send_all(PREFACE + EMPTY_SETTINGS + SETTINGS_ACK)
                await trio.sleep(0.5)
                baseline = rss_bytes(pid)
                batch = flood_frame * 4096
                sent = 0
                while True:
                    try:
                        await stream.send_all(batch)
                    except (trio.BrokenResourceError, OSError):
                        break
                    sent += len(batch)
                    assert sent < 1024 * MIB, "the server never closed the flooding connection"
            growth = rss_bytes(pid) - baseline
        print(f"{name} flood: closed after {sent / MIB:.1f} MiB sent; server RSS growth {growth / MIB:.1f} MiB")
        assert "ENHANCE_YOUR_CALM" in log_text(tmp_path)
        assert growth < 32 * MIB, (growth, sent)
        # Still serving others.
        peer = await H2Peer.connect(mock.port)
        async with peer.stream:
            with trio.fail_after(30):
                await peer.handshake()
    finally:
        await mock.aclose()


async def test_a_peer_that_reads_its_acks_may_ping_as_much_as_it_likes(tmp_path):
    mock = await start_mock(tmp_path)
    try:
        with trio.fail_after(120):
            peer = await H2Peer.connect(mock.port)
            async with peer.stream:
                await peer.handshake()
                pings = 0
                for _ in range(20):
                    await peer.stream.send_all(PING_FRAME * 2000)
                    pings += 2000
                    await peer.wait_for(
                        lambda pings=pings: sum(isinstance(e, h2.events.PingAcknowledged) for e in peer.events) >= pings
                    )
                    peer.events.clear()
                    pings = 0
                assert not peer.closed and peer.goaway() is None
        assert "ENHANCE_YOUR_CALM" not in log_text(tmp_path)
    finally:
        await mock.aclose()


# --- frame size ---------------------------------------------------------------------------------------------


async def test_an_oversized_frame_header_is_rejected_before_its_payload(tmp_path):
    mock = await start_mock(tmp_path)
    try:
        with trio.fail_after(30):
            stream = await raw_connect(mock.port)
            async with stream:
                # A 16 MiB - 1 DATA frame header and not one byte of its payload: the answer must not wait
                # for the payload.
                await stream.send_all(PREFACE + EMPTY_SETTINGS + frame_header(DATA, 2**24 - 1, stream_id=1))
                frames = await read_until_closed(stream)
        assert goaway_codes(frames) == [FRAME_SIZE_ERROR], frames
    finally:
        await mock.aclose()


# --- decompression bomb -----------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_decompression_bomb_fails_with_resource_exhausted_without_inflating(tmp_path, encoding):
    """1 GiB of zeros compressed to ~1 MiB: the mock (64 MiB message limit) answers RESOURCE_EXHAUSTED and
    its peak RSS grows by about the limit at most, not by the bomb's size."""
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    compressor = zlib.compressobj(9, zlib.DEFLATED, wbits)
    zeros = bytes(MIB)
    bomb = b"".join([compressor.compress(zeros) for _ in range(1024)] + [compressor.flush()])
    assert len(bomb) < 2 * MIB
    mock = await start_mock(tmp_path)
    try:
        pid = mock.process.pid
        with trio.fail_after(120):
            peer = await H2Peer.connect(mock.port)
            async with peer.stream:
                await peer.handshake()
                peak_before = peak_rss_bytes(pid)
                stream_id = peer.open_call(GENERATE, bomb, encoding=encoding)
                await peer.flush()
                await peer.wait_for(lambda: peer.status_of(stream_id) is not None)
                assert peer.status_of(stream_id) == RESOURCE_EXHAUSTED
                # The connection still serves: a plain request on it completes.
                ok = peer.open_call(GENERATE, generate_request(4, "after-bomb"))
                await peer.flush()
                await peer.wait_for(lambda: peer.status_of(ok) is not None)
                assert peer.status_of(ok) == "0"
        growth = peak_rss_bytes(pid) - peak_before
        print(f"{encoding} bomb ({len(bomb) / MIB:.2f} MiB -> 1 GiB): peak RSS growth {growth / MIB:.1f} MiB")
        assert growth < 96 * MIB, growth
    finally:
        await mock.aclose()


# --- streams that are never read ----------------------------------------------------------------------------


async def test_streams_that_are_never_read_keep_the_mock_memory_flat(tmp_path):
    """256 long generations on a connection whose peer opened huge windows and then never reads a byte."""
    streams = 256
    engine_args = {**FAST_ENGINE_ARGS, "max_num_seqs": streams, "num_gpu_blocks": 65536}
    mock = await start_mock(tmp_path, engine_args=engine_args)
    try:
        pid = mock.process.pid
        with trio.fail_after(120):
            baseline = rss_bytes(pid)
            peer = await H2Peer.connect(mock.port, window=2**31 - 1, receive_buffer=4096)
            async with peer.stream:
                await peer.handshake()
                for i in range(streams):
                    peer.open_call(GENERATE_STREAM, generate_request(32_768, f"unread-{i}"))
                await peer.flush()
                # From here on nothing is read. The engine keeps generating (coalesced, not buffered).
                cpu_before = sum(mock_cpu(pid))
                await trio.sleep(5)
                settled = rss_bytes(pid)
                await trio.sleep(10)
                final = rss_bytes(pid)
                cpu_spent = sum(mock_cpu(pid)) - cpu_before
        print(
            f"256 unread streams: RSS {baseline / MIB:.0f} MiB -> {settled / MIB:.0f} MiB (5 s) -> "
            f"{final / MIB:.0f} MiB (15 s); mock CPU {cpu_spent:.1f} s"
        )
        assert cpu_spent > 1.0, "the engine did not keep generating"
        assert final - settled < 16 * MIB, (baseline, settled, final)
        assert final - baseline < 96 * MIB, (baseline, settled, final)
    finally:
        await mock.aclose()


def mock_cpu(pid: int) -> tuple[float, float]:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user, times.system


# --- header floods ------------------------------------------------------------------------------------------


def _request_header_block(extra: list[tuple[str, str]]) -> bytes:
    import hpack

    return hpack.Encoder().encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", GENERATE),
            (":authority", "x"),
            ("te", "trailers"),
            ("content-type", "application/grpc"),
            *extra,
        ],
        huffman=False,  # (pure-Python Huffman coding of ~1 MB would dominate the test's time)
    )


async def _send_header_frames(tmp_path, fragments: list[bytes], *, end_headers: bool) -> tuple[list, int]:
    """HEADERS + CONTINUATION frames carrying ``fragments`` (END_HEADERS on the last one if asked)."""
    from hostile_peers import frame

    mock = await start_mock(tmp_path)
    try:
        pid = mock.process.pid
        with trio.fail_after(60):
            stream = await raw_connect(mock.port)
            async with stream:
                await stream.send_all(PREFACE + EMPTY_SETTINGS + SETTINGS_ACK)
                baseline = rss_bytes(pid)
                frames = [frame(0x1, 0x0, 1, fragments[0])] + [frame(0x9, 0x0, 1, f) for f in fragments[1:]]
                if end_headers:
                    last = fragments[-1]
                    frames[-1] = frame(0x1 if len(fragments) == 1 else 0x9, 0x4, 1, last)
                try:
                    for f in frames:
                        await stream.send_all(f)
                except (trio.BrokenResourceError, OSError):
                    pass  # closed under our feet: what we want
                answer = await read_until_closed(stream)
            growth = rss_bytes(pid) - baseline
        # The server still serves a well-behaved client.
        peer = await H2Peer.connect(mock.port)
        async with peer.stream:
            with trio.fail_after(30):
                await peer.handshake()
        return answer, growth
    finally:
        await mock.aclose()


async def test_a_continuation_flood_is_cut_off_with_goaway(tmp_path):
    block = _request_header_block([])
    fragments = [block] + [b"\x00" * 16_384] * 4096  # 64 MiB of CONTINUATION without END_HEADERS
    frames, growth = await _send_header_frames(tmp_path, fragments, end_headers=False)
    print(f"CONTINUATION flood: GOAWAY codes {goaway_codes(frames)}; RSS growth {growth / MIB:.1f} MiB")
    assert goaway_codes(frames) and goaway_codes(frames)[0] != 0, frames
    assert growth < 16 * MIB, growth


async def test_a_huge_header_block_is_refused_with_enhance_your_calm(tmp_path):
    block = _request_header_block([("x-huge", "h" * 900_000)])  # ~900 KB in one header value
    fragments = [block[i : i + 16_384] for i in range(0, len(block), 16_384)]
    frames, growth = await _send_header_frames(tmp_path, fragments, end_headers=True)
    print(f"huge header block: GOAWAY codes {goaway_codes(frames)}; RSS growth {growth / MIB:.1f} MiB")
    statuses = [payload for kind, _, _, payload in frames if kind == 0x1]
    assert goaway_codes(frames) or statuses, frames  # refused: the connection or the stream
    assert growth < 16 * MIB, growth


async def test_the_sidecar_keeps_serving_across_the_mocks_idle_goaways(caplog):
    """The mock closes the sidecar's idle pooled connections (GOAWAY, then close); later requests succeed."""
    import logging

    from reliability_fakes import drive, mock_config, mock_request, sidecar_config

    caplog.set_level(logging.DEBUG, logger="trio_sidecar.transport.server")
    from trio_sidecar.api import open_sidecar
    from trio_sidecar.mock import open_mock_server

    with trio.fail_after(90):
        async with open_mock_server(mock_config(idle_timeout=0.5)) as mock:
            async with open_sidecar(sidecar_config(mock.address, grpc_connections=2)) as sidecar:
                for round_ in range(3):
                    outcome = await drive(sidecar, mock_request(4), f"after-idle-{round_}")
                    assert outcome.error is None and len(outcome.tokens) == 4, outcome
                    await trio.sleep(1.5)  # every connection without a stream is closed meanwhile
    assert "idle for 0.5 s" in caplog.text
