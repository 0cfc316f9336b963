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


def run_soak(tmp_path: Path, *args: str) -> dict:
    report = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "soak.py"), *args, "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(report.read_text())
    trio_side = next(side for side in result["sides"] if side["side"] == "trio")
    assert proc.returncode == 0 and trio_side["problems"] == [], proc.stdout[-4000:]
    assert all(trio_side["answered"][kind] > 50 for kind in ("unary", "stream", "dropped", "invalid")), trio_side
    return result


@pytest.mark.timeout(900)
def test_an_idle_then_loaded_sidecar_on_a_grpc_core_server_answers_everything_as_expected(tmp_path):
    """Idle past gRPC-core's ping-strike window (two strikes at the stock 5-minute minimum ping interval took
    a 10 s keepalive out of service at about 44 s), then three minutes of mixed load."""
    require_dynamo()
    run_soak(tmp_path, "--backend", "grpcio", "--idle", "60", "--duration", "180", "--clients", "12")


@pytest.mark.timeout(900)
def test_a_loaded_sidecar_on_the_mock_answers_everything_as_expected(tmp_path):
    require_dynamo()
    run_soak(tmp_path, "--backend", "mock", "--duration", "180", "--clients", "12")
