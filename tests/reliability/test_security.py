"""Every listener binds 127.0.0.1 unless told otherwise.

* ``serve_grpc`` without a host binds the loopback address only.
* The mock's default listen address is loopback, and the mock process binds *all* of its listeners (gRPC and
  the ZMQ KV-event PUB sockets) on the IP of ``--listen``.
* The sidecar itself opens no listener (only Dynamo's request plane listens, on ``DYN_TCP_RPC_HOST``).
"""

from __future__ import annotations

import json

import psutil
import trio
from reliability_fakes import MockProcess, drive, mock_config, mock_request, sidecar_config

LOOPBACK = "127.0.0.1"


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    return [
        (conn.laddr.ip, conn.laddr.port)
        for conn in psutil.Process(pid).net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]


async def test_serve_grpc_binds_loopback_by_default(nursery):
    from trio_sidecar.transport import HealthServicer, serve_grpc

    server = await nursery.start(lambda task_status: serve_grpc([HealthServicer()], port=0, task_status=task_status))
    assert server.host == LOOPBACK
    mine = [addr for addr in listening_addresses(psutil.Process().pid) if addr[1] == server.port]
    assert mine == [(LOOPBACK, server.port)]


def test_mock_default_listen_address_is_loopback():
    from trio_sidecar.mock import MockConfig
    from trio_sidecar.mock.cli import build_parser

    assert MockConfig().listen == f"{LOOPBACK}:50051"
    assert build_parser().parse_args([]).listen in (None, f"{LOOPBACK}:50051")


async def test_mock_process_binds_every_listener_on_the_listen_ip(tmp_path):
    engine_args = {"block_size": 4, "speedup_ratio": 0.0, "dp_size": 2, "enable_prefix_caching": True}
    mock = MockProcess(["--extra-engine-args", json.dumps(engine_args)], tmp_path / "mock.log")
    try:
        with trio.fail_after(60):
            port = await mock.start()
            addresses = listening_addresses(mock.process.pid)
            # gRPC + one ZMQ PUB per DP rank, all on loopback.
            assert (LOOPBACK, port) in addresses
            assert len(addresses) >= 3, addresses
            assert {ip for ip, _ in addresses} == {LOOPBACK}, addresses
    finally:
        await mock.aclose()


async def test_sidecar_opens_no_listener():
    from trio_sidecar.api import open_sidecar
    from trio_sidecar.mock import open_mock_server

    me = psutil.Process()
    with trio.fail_after(60):
        async with open_mock_server(mock_config()) as mock:
            before = set(listening_addresses(me.pid))
            async with open_sidecar(sidecar_config(mock.address)) as sidecar:
                outcome = await drive(sidecar, mock_request(2), "listen-check")
                assert outcome.error is None
                assert set(listening_addresses(me.pid)) == before
