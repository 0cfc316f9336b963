"""The ``--mock`` variants of ``launch/*.sh`` as real processes on 127.0.0.1.

Each script runs as a subprocess in its own session (so the test can clean up by process group if the
script itself fails), with free ports, ``TMPDIR`` in the test's temporary directory and the Python of this
test run. The test waits for the script's "ready" line, sends one completion through the frontend, stops
the script with a signal and checks that every process it started is gone, that it removed its working
directory, and that it exits with the shell's signal status.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from topology import etcd_get_prefix

from trio_sidecar._devtools import local

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
READY = "trio-sidecar launch ready:"
START_TIMEOUT = 90.0
STOP_TIMEOUT = 45.0


def _require_dynamo() -> None:
    pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime 1.6.1 is not installed")
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo 1.6.1 (frontend) is not installed")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    pytest.importorskip("tokenizers")
    spec = importlib.util.spec_from_file_location("launch_make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.make_tiny_model(tmp_path_factory.mktemp("launch-model") / "tiny")


class Script:
    """One launch script run: output in a file, descendants snapshotted once ready."""

    def __init__(self, name: str, tmp_path: Path, env: dict[str, str], args: tuple[str, ...] = ("--mock",)) -> None:
        self.out_path = tmp_path / f"{name}.out"
        self.tmpdir = tmp_path / "tmp"
        self.tmpdir.mkdir()
        self._out = open(self.out_path, "wb")  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen(
            ["bash", str(LAUNCH / name), *args],
            env={**env, "TMPDIR": str(self.tmpdir)},
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.children: list = []
        self.descendants: list = []

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        psutil = pytest.importorskip("psutil")
        deadline = time.monotonic() + START_TIMEOUT
        while READY not in self.output():
            assert self.popen.poll() is None, f"the script exited with {self.popen.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"not ready after {START_TIMEOUT}s:\n{self.output()}"
            time.sleep(0.2)
        # The long-lived children (``python -m ...``) and everything below them; the script's own short-lived
        # helpers (``sleep``, the readiness probe ``python -``) are left out.
        self.children = [p for p in psutil.Process(self.popen.pid).children() if "-m" in _cmdline(p)]
        self.descendants = [*self.children, *(d for c in self.children for d in c.children(recursive=True))]

    def leftover_processes(self) -> list:
        """Live processes from the snapshot, plus any process still in a session a child created (each child
        runs under ``setsid``, so this also finds processes started after the snapshot, even reparented)."""
        psutil = pytest.importorskip("psutil")
        sessions = {p.pid for p in self.children}
        found = {}
        for proc in self.descendants:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    found[proc.pid] = proc
            except psutil.Error:
                continue
        for pid in psutil.pids():
            try:
                if os.getsid(pid) in sessions and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    found[pid] = psutil.Process(pid)
            except (OSError, psutil.Error):
                continue
        return list(found.values())

    def leftovers(self) -> list[str]:
        return [" ".join(_cmdline(p)) or str(p.pid) for p in self.leftover_processes()]

    def close(self) -> None:
        """Fallback cleanup by PID: the script's process group, then every leftover process."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        for proc in self.leftover_processes():
            try:
                proc.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._out.close()


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001 - exited meanwhile
        return []


def _env(**ports: int) -> dict[str, str]:
    env = local.dynamo_env("/nonexistent")  # the script sets DYN_FILE_KV itself
    env.pop("DYN_FILE_KV")
    env.update({k: str(v) for k, v in ports.items()}, PYTHON=sys.executable, STOP_TIMEOUT="20")
    return env


CASES = [
    # script, per-script environment (gRPC ports 0: the mocks choose), signal, expected exit status
    pytest.param("agg.sh", {"GRPC_PORT": 0}, signal.SIGINT, 130, id="agg-sigint"),
    pytest.param(
        "disagg.sh", {"DECODE_GRPC_PORT": 0, "PREFILL_GRPC_PORT": 0}, signal.SIGTERM, 143, id="disagg-sigterm"
    ),
    pytest.param(
        "agg_kv_router.sh", {"WORKER0_GRPC_PORT": 0, "WORKER1_GRPC_PORT": 0}, signal.SIGINT, 130, id="kv-router-sigint"
    ),
]
EXPECTED_CHILDREN = {"agg.sh": 3, "disagg.sh": 5, "agg_kv_router.sh": 5}
WORKERS = {"agg.sh": 1, "disagg.sh": 2, "agg_kv_router.sh": 2}  # sidecars, each one Dynamo instance


@pytest.mark.dynamo
@pytest.mark.parametrize(("name", "ports", "signum", "status"), CASES)
def test_launch_script_serves_a_completion_and_stops_every_child(name, ports, signum, status, tiny_model, tmp_path):
    _require_dynamo()
    http_port = local.free_port()
    script = Script(name, tmp_path, {**_env(HTTP_PORT=http_port, **ports), "MODEL": str(tiny_model)})
    try:
        script.wait_ready()
        out = script.output()
        assert f"curl -s http://127.0.0.1:{http_port}/v1/completions" in out
        # The mocks, the frontend and the sidecars, each a Python process of this test run.
        assert len(script.children) == EXPECTED_CHILDREN[name], [p.cmdline() for p in script.children]
        for proc in script.children:
            assert proc.cmdline()[0] == sys.executable

        status_code, body = local.post_json(
            http_port,
            "/v1/completions",
            {"model": "tiny", "prompt": "hello world", "max_tokens": 4, "ignore_eos": True},
        )
        assert status_code == 200, body
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["text"].startswith("<token:")
        assert body["usage"]["completion_tokens"] == 4

        script.popen.send_signal(signum)
        try:
            returncode = script.popen.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the script did not stop within {STOP_TIMEOUT}s:\n{script.output()}")
        out = script.output()
        assert returncode == status, out
        assert f"stopped {EXPECTED_CHILDREN[name]} process(es)" in out
        assert "did not stop within" not in out
        assert script.leftovers() == []
        assert list(script.tmpdir.glob("trio-sidecar-launch.*")) == []
    finally:
        script.close()


@pytest.mark.dynamo
def test_launch_script_stops_everything_when_a_child_dies(tiny_model, tmp_path):
    """The mock is killed (by its PID): the script reports it, stops the rest and exits 1, keeping its logs."""
    _require_dynamo()
    http_port = local.free_port()
    script = Script("agg.sh", tmp_path, {**_env(HTTP_PORT=http_port, GRPC_PORT=0), "MODEL": str(tiny_model)})
    try:
        script.wait_ready()
        mock = [p for p in script.children if "mock" in p.cmdline()]
        assert len(mock) == 1
        mock[0].kill()
        returncode = script.popen.wait(STOP_TIMEOUT)
        out = script.output()
        assert returncode == 1, out
        assert "mock exited" in out
        assert script.leftovers() == []
        kept = list(script.tmpdir.glob("trio-sidecar-launch.*/logs/trio-sidecar.log"))
        assert len(kept) == 1
    finally:
        script.close()


def test_launch_scripts_default_to_loopback_and_document_their_variables():
    """Static checks: every listener the scripts start is given 127.0.0.1 (only HTTP_HOST is overridable)."""
    text = (LAUNCH / "agg.sh").read_text()
    assert "LOOPBACK=127.0.0.1" in text
    assert "HTTP_HOST=${HTTP_HOST:-$LOOPBACK}" in text
    assert '--listen "$LOOPBACK:$port"' in text
    assert 'serve "$MODEL" --host "$LOOPBACK"' in text
    for var in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST"):
        assert f"export {var}=$LOOPBACK" in text
    for name in ("agg.sh", "disagg.sh", "agg_kv_router.sh"):
        script = LAUNCH / name
        assert os.access(script, os.X_OK), f"{name} is not executable"
        header = script.read_text()
        assert "unauthenticated" in header
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["agg.sh", "disagg.sh", "agg_kv_router.sh"])
def test_launch_script_help_and_unknown_arguments(name, tmp_path):
    env = {**_env(), "TMPDIR": str(tmp_path)}
    shown = subprocess.run(["bash", str(LAUNCH / name), "--help"], env=env, capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0
    assert "Usage:" in shown.stderr and "--mock" in shown.stderr
    assert "--etcd-nats" in shown.stderr
    bad = subprocess.run(["bash", str(LAUNCH / name), "--bogus"], env=env, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1
    assert "unknown argument: --bogus" in bad.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was created


@pytest.mark.dynamo  # the script checks PYTHON for Dynamo before it looks for vLLM
def test_launch_script_without_vllm_fails_before_starting_anything(tmp_path):
    env = {**_env(), "TMPDIR": str(tmp_path), "VLLM": str(tmp_path / "no-such-vllm-rs")}
    result = subprocess.run(["bash", str(LAUNCH / "agg.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "vLLM server command not found" in result.stderr
    assert "started" not in result.stderr


@pytest.mark.parametrize("name", ["agg.sh", "disagg.sh", "agg_kv_router.sh"])
def test_launch_script_with_a_python_lacking_its_packages_names_them_and_starts_nothing(name, tmp_path):
    """A PYTHON that cannot import trio-sidecar, Dynamo or tokenizers (here this interpreter without its
    site-packages, ``-S``) stops the script before anything starts, naming each missing package."""
    python = tmp_path / "bare-python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    work = tmp_path / "tmp"
    work.mkdir()
    env = {**_env(), "TMPDIR": str(work), "PYTHON": str(python)}
    result = subprocess.run(
        ["bash", str(LAUNCH / name), "--mock"], env=env, cwd=work, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1
    missing = "trio-sidecar, ai-dynamo-runtime 1.6.1, ai-dynamo 1.6.1 (the frontend), tokenizers"
    assert f"PYTHON={python} lacks {missing}; run `make install`" in result.stderr
    assert "started" not in result.stderr
    assert list(work.iterdir()) == []  # nothing was created


@pytest.mark.dynamo
@pytest.mark.parametrize("name", ["agg.sh", "disagg.sh", "agg_kv_router.sh"])
def test_launch_script_etcd_nats_mode_serves_through_etcd_and_nats_and_stops_them(name, tiny_model, tmp_path):
    """``--etcd-nats``: the script also starts etcd and NATS on 127.0.0.1, the workers register in that etcd
    (not in a discovery directory) and the request goes over NATS; on SIGINT both services stop with the rest."""
    _require_dynamo()
    psutil = pytest.importorskip("psutil")
    ports = {
        k: local.free_port() for k in ("HTTP_PORT", "ETCD_PORT", "ETCD_PEER_PORT", "NATS_PORT", "NATS_MONITOR_PORT")
    }
    grpc = {
        "agg.sh": {"GRPC_PORT": 0},
        "disagg.sh": {"DECODE_GRPC_PORT": 0, "PREFILL_GRPC_PORT": 0},
        "agg_kv_router.sh": {"WORKER0_GRPC_PORT": 0, "WORKER1_GRPC_PORT": 0},
    }[name]
    script = Script(name, tmp_path, {**_env(**ports, **grpc), "MODEL": str(tiny_model)}, args=("--mock", "--etcd-nats"))
    try:
        script.wait_ready()
        services = {
            Path(_cmdline(p)[0]).name: p
            for p in psutil.Process(script.popen.pid).children()
            if _cmdline(p) and Path(_cmdline(p)[0]).name in ("etcd", "nats-server")
        }
        assert sorted(services) == ["etcd", "nats-server"], script.output()
        for proc in services.values():
            listening = [c.laddr for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN]
            assert listening and {addr.ip for addr in listening} == {"127.0.0.1"}, listening
        assert len(script.children) == EXPECTED_CHILDREN[name]

        status_code, body = local.post_json(
            ports["HTTP_PORT"],
            "/v1/completions",
            {"model": "tiny", "prompt": "hello world", "max_tokens": 4, "ignore_eos": True},
        )
        assert status_code == 200, body
        assert body["usage"]["completion_tokens"] == 4
        # Every worker registered in this etcd, with a lease (and nothing went to a discovery directory).
        keys = etcd_get_prefix(ports["ETCD_PORT"], "v1/instances/dynamo/")
        generate = [lease for key, (_, lease) in keys.items() if "/generate/" in key]
        assert len(generate) == WORKERS[name] and all(generate), keys
        assert list(script.tmpdir.glob("trio-sidecar-launch.*/file-kv/*")) == []
        assert "NATS on nats://127.0.0.1:" in script.output()

        script.popen.send_signal(signal.SIGINT)
        try:
            returncode = script.popen.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the script did not stop within {STOP_TIMEOUT}s:\n{script.output()}")
        out = script.output()
        assert returncode == 130, out
        assert f"stopped {EXPECTED_CHILDREN[name] + 2} process(es)" in out
        assert "did not stop within" not in out
        assert [p for p in services.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
        assert script.leftovers() == []
        assert list(script.tmpdir.glob("trio-sidecar-launch.*")) == []
    finally:
        for proc in locals().get("services", {}).values():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        script.close()
