"""A mixed load of at least three minutes through ``dynamo.frontend``, the native sidecar and trio-sidecar side
by side (``bench/soak.py``), against a gRPC-core (``grpc.aio``) vLLM stand-in and against the mock.

trio-sidecar must answer every request as expected (no 503 while vLLM serves, idle or loaded), end every
engine stream, never let a dropped stream run to its end, and keep its RSS bounded; the native sidecar runs
the same load beside it as the reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dynamo_harness import require_dynamo

pytestmark = [pytest.mark.slow, pytest.mark.dynamo]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_idle_then_loaded_sidecars_on_a_grpc_core_server_and_on_the_mock_answer_everything_as_expected(tmp_path):
    """Idle past gRPC-core's ping-strike window (with a 10 s keepalive and the stock 5-minute minimum ping
    interval, two strikes took trio-sidecar out of service at about 44 s), then three minutes of mixed load;
    both backends and both sidecars at once (48 clients)."""
    require_dynamo()
    report = tmp_path / "soak.json"
    argv = ["--backend", "grpcio,mock", "--idle", "50", "--duration", "180", "--clients", "12", "--json", str(report)]
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "soak.py"), *argv], capture_output=True, text=True, timeout=840
    )
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    sides = {side["side"]: side for side in json.loads(report.read_text())["sides"]}
    assert set(sides) == {"native@grpcio", "trio@grpcio", "native@mock", "trio@mock"}
    for name in ("trio@grpcio", "trio@mock"):
        assert sides[name]["problems"] == [], (name, sides[name], proc.stdout[-4000:])
        assert all(sides[name]["answered"].get(kind, 0) > 50 for kind in ("unary", "stream", "dropped", "invalid"))
    assert proc.returncode == 0, proc.stdout[-4000:]
