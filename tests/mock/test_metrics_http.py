"""The mock's HTTP ``/metrics`` serves vLLM's metric names (``vllm:*``, labels ``model_name`` and ``engine``) for
what it simulates: running and waiting requests, KV-cache usage, prompt and generation tokens, time to first
token, inter-token latency and end-to-end latency, scraped over a real socket."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import trio
from mock_helpers import FAST_ARGS, collect, gen, running_mock, stream_tokens, wait_drained

from trio_sidecar.mock.metrics import serve_metrics_http

SAMPLE = re.compile(r"^(?P<name>[a-z0-9_:]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


async def _http_get(port: int, path: str) -> tuple[int, str, str]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers.get("Content-Type", ""), body.decode()


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        assert match, line
        labels = frozenset(tuple(pair.split("=", 1)) for pair in match["labels"].split(","))
        out[(match["name"], frozenset((k, v.strip('"')) for k, v in labels))] = float(match["value"])
    return out


def _value(samples, name: str, **labels: str) -> float:
    want = frozenset({"model_name": "m", "engine": "0", **labels}.items())
    return samples[(name, want)]


async def test_scraping_metrics_reports_vllm_names_for_simulated_requests():
    with trio.fail_after(30):
        async with running_mock(model="m", engine_args={"speedup_ratio": 1000.0}) as (mock, channel):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve_metrics_http, mock.request_metrics, "127.0.0.1", 0)
                status, kind, text = await _http_get(port, "/metrics")
                assert status == 200 and kind.startswith("text/plain; version=0.0.4"), (status, kind)
                before = _samples(text)
                assert _value(before, "vllm:generation_tokens_total") == 0
                assert _value(before, "vllm:num_requests_running") == 0

                first = await collect(channel, gen("a", prompt=list(range(1, 9)), max_new_tokens=5))
                second = await collect(channel, gen("b", prompt=list(range(1, 5)), max_new_tokens=3))
                assert len(stream_tokens(first)) == 5 and len(stream_tokens(second)) == 3
                await wait_drained(mock)

                status, _, text = await _http_get(port, "/metrics")
                after = _samples(text)
                assert _value(after, "vllm:prompt_tokens_total") == 8 + 4
                assert _value(after, "vllm:generation_tokens_total") == 5 + 3
                assert _value(after, "vllm:request_success_total", finished_reason="length") == 2
                assert _value(after, "vllm:request_success_total", finished_reason="abort") == 0
                assert _value(after, "vllm:time_to_first_token_seconds_count") == 2
                assert _value(after, "vllm:e2e_request_latency_seconds_count") == 2
                # tokens after the first delivery each observe an interval: at most 4 + 2
                assert 0 < _value(after, "vllm:inter_token_latency_seconds_count") <= 6
                assert _value(after, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == 2
                assert _value(after, "vllm:kv_cache_usage_perc") == 0
                for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                    assert _value(after, name) == 0
                assert (await _http_get(port, "/other"))[0] == 404
                nursery.cancel_scope.cancel()


async def test_running_waiting_and_kv_usage_follow_the_scheduler_while_requests_run():
    with trio.fail_after(30):
        engine_args = {"speedup_ratio": 1.0, "max_num_seqs": 1, "num_gpu_blocks": 64}
        async with running_mock(model="m", engine_args=engine_args) as (mock, channel):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve_metrics_http, mock.request_metrics, "127.0.0.1", 0)
                for rid in ("x", "y"):
                    nursery.start_soon(collect, channel, gen(rid, max_new_tokens=10_000))
                await mock.metrics_value(0).wait_value(lambda m: m.running_requests == 1 and m.waiting_requests == 1)
                samples = _samples((await _http_get(port, "/metrics"))[2])
                assert _value(samples, "vllm:num_requests_running") == 1
                assert _value(samples, "vllm:num_requests_waiting") == 1
                assert 0 < _value(samples, "vllm:kv_cache_usage_perc") <= 1
                nursery.cancel_scope.cancel()


@pytest.mark.parametrize("dp", [2])
async def test_the_cli_serves_metrics_per_engine_on_its_metrics_port(dp):
    command = [
        sys.executable, "-m", "trio_sidecar.mock", "--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "0",
        "--model", "m", "--data-parallel-size", str(dp), "--extra-engine-args", json.dumps(FAST_ARGS),
        "--log-level", "warning",
    ]  # fmt: skip
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with trio.fail_after(30):
            lines = b""
            while lines.count(b"\n") < 2:
                chunk = await process.stdout.receive_some(1)
                assert chunk, (lines, await process.stderr.receive_some(65536))
                lines += chunk
        listening, metrics = lines.decode().splitlines()
        assert re.fullmatch(r"trio-sidecar mock listening on 127\.0\.0\.1:\d+", listening)
        match = re.fullmatch(r"trio-sidecar mock metrics on http://127\.0\.0\.1:(\d+)/metrics", metrics)
        assert match, metrics
        with trio.fail_after(10):
            status, _, text = await _http_get(int(match[1]), "/metrics")
        samples = _samples(text)
        assert status == 200
        for engine in map(str, range(dp)):
            assert _value(samples, "vllm:num_requests_running", engine=engine) == 0
        process.terminate()
        with trio.fail_after(10):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()  # by PID: only the child this test started
        with trio.CancelScope(shield=True):
            await process.wait()
            await process.stdout.aclose()
            await process.stderr.aclose()
