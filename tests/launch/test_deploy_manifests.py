"""The Kubernetes manifests (``deploy/*.yaml``) and the image (``deploy/Dockerfile``).

Every manifest is parsed (PyYAML); each worker pod must run vLLM as a native sidecar (an init container with
``restartPolicy: Always``) whose listeners are all on 127.0.0.1, with TCP startup/readiness probes that can
reach that loopback listener, and ``trio-sidecar run`` as the main container with flags that exist in
``trio-sidecar run --help``, pointing at the same port, and no model flag.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
LOOPBACK = "127.0.0.1"

yaml = pytest.importorskip(
    "yaml",
    reason="PyYAML is not installed: it must be added to the `test` extra in pyproject.toml (manifest tests "
    "parse YAML with it; a hand-written parser is not acceptable)",
)


@pytest.fixture(scope="module")
def run_flags() -> set[str]:
    """Every long option `trio-sidecar run --help` documents."""
    out = subprocess.run(
        [sys.executable, "-m", "trio_sidecar", "run", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out))
    assert "--grpc-endpoint" in flags and "--disaggregation-mode" in flags
    return flags


def _documents(path: Path) -> list[dict]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _graphs() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in MANIFESTS for doc in _documents(path)]


def _workers(graph: dict) -> list[dict]:
    return [c for c in graph["spec"]["components"] if c["type"] != "frontend"]


def _option(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag value`` or ``--flag=value``); None when absent."""
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _argv(container: dict) -> list[str]:
    return [str(a) for a in [*container.get("command", []), *container.get("args", [])]]


def _vllm(component: dict) -> dict:
    natives = [
        c for c in component["podTemplate"]["spec"].get("initContainers", []) if c.get("restartPolicy") == "Always"
    ]
    assert len(natives) == 1, f"{component['name']}: expected one native sidecar (init, restartPolicy Always)"
    return natives[0]


def _main(component: dict) -> dict:
    mains = [c for c in component["podTemplate"]["spec"]["containers"] if c["name"] == "main"]
    assert len(mains) == 1, component["name"]
    return mains[0]


def test_deploy_manifests_exist_and_parse():
    assert {p.name for p in MANIFESTS} >= {"agg.yaml", "disagg.yaml"}
    for name, graph in _graphs():
        assert graph["apiVersion"] == "nvidia.com/v1beta1", name
        assert graph["kind"] == "DynamoGraphDeployment", name
        types = [c["type"] for c in graph["spec"]["components"]]
        assert types.count("frontend") == 1, name
        assert _workers(graph), name


def test_deploy_vllm_runs_as_a_native_sidecar_bound_to_loopback():
    for name, graph in _graphs():
        for component in _workers(graph):
            vllm = _vllm(component)
            argv = _argv(vllm)
            where = f"{name}:{component['name']}"
            assert argv[:2] == ["vllm-rs", "serve"], where
            # `--host` sets every vLLM listener, the gRPC one included (docs/reference/real-vllm.md#starting-the-server).
            assert _option(argv, "--host") == LOOPBACK, where
            grpc_port = _option(argv, "--grpc-port")
            assert grpc_port and grpc_port.isdigit(), where
            assert _option(argv, "--port") not in (None, grpc_port), where
            assert "--headless" not in argv and "--grpc" not in argv, where
            assert not any("0.0.0.0" in a or "tcp://*" in a for a in argv), where
            for flag in ("--kv-events-config",):
                if (value := _option(argv, flag)) is not None:
                    endpoint = json.loads(value)["endpoint"]
                    assert endpoint.startswith(f"tcp://{LOOPBACK}:"), where
            assert "ports" not in vllm, f"{where}: vLLM's gRPC port must not be declared or exposed"


def test_deploy_vllm_probes_are_tcp_checks_of_the_loopback_grpc_port():
    """The kubelet's tcpSocket/grpc probes dial the pod IP and could never reach 127.0.0.1; the probes run in
    the container instead. Each probe command is executed here against a real listener and a closed port."""
    for name, graph in _graphs():
        for component in _workers(graph):
            vllm = _vllm(component)
            grpc_port = int(_option(_argv(vllm), "--grpc-port"))
            for kind in ("startupProbe", "readinessProbe"):
                probe = vllm.get(kind)
                where = f"{name}:{component['name']}:{kind}"
                assert probe, where
                assert "tcpSocket" not in probe and "grpc" not in probe and "httpGet" not in probe, where
                command = probe["exec"]["command"]
                assert LOOPBACK in " ".join(command) and str(grpc_port) in " ".join(command), where
                _check_probe_command(command, grpc_port, where)


def _check_probe_command(command: list[str], port: int, where: str) -> None:
    assert command[0] == "python3", where
    code = command[-1]
    with socket.socket() as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen()
        free = listener.getsockname()[1]
        ok = subprocess.run([sys.executable, "-c", code.replace(str(port), str(free))], capture_output=True, timeout=30)
        assert ok.returncode == 0, (where, ok.stderr)
    closed = subprocess.run([sys.executable, "-c", code.replace(str(port), str(free))], capture_output=True, timeout=30)
    assert closed.returncode != 0, f"{where}: the probe passes against a closed port"


def test_deploy_main_container_is_trio_sidecar_run_with_known_flags(run_flags):
    for name, graph in _graphs():
        for component in _workers(graph):
            where = f"{name}:{component['name']}"
            argv = _argv(_main(component))
            assert argv[:2] == ["trio-sidecar", "run"], where
            flags = [a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")]
            unknown = sorted(set(flags) - run_flags)
            assert unknown == [], f"{where}: not in `trio-sidecar run --help`: {unknown}"
            # No model path: identity comes from vLLM's Control service.
            assert not any(f in flags for f in ("--model", "--model-path", "--served-model-name")), where
            grpc_port = _option(_argv(_vllm(component)), "--grpc-port")
            assert _option(argv, "--grpc-endpoint") == f"{LOOPBACK}:{grpc_port}", where
            mode = _option(argv, "--disaggregation-mode")
            expected = component["type"] if component["type"] in ("prefill", "decode") else None
            assert mode == expected, where


def test_deploy_main_container_arguments_pass_the_cli_and_pre_network_checks():
    """The exact argv of every main container goes through the CLI parser and the pre-network checks (docs/reference/sidecar.md#pre-network-checks)
    (no environment, no sockets): the endpoint is the pod-local vLLM and the mode matches the component."""
    from trio_sidecar.cli import parse_run_args
    from trio_sidecar.core.config import prepare

    for name, graph in _graphs():
        for component in _workers(graph):
            where = f"{name}:{component['name']}"
            config, options = parse_run_args(_argv(_main(component))[2:], environ={})
            endpoint = prepare(config, options, dynamo_required=False)
            assert (endpoint.host, str(endpoint.port)) == (LOOPBACK, _option(_argv(_vllm(component)), "--grpc-port")), (
                where
            )
            expected = component["type"] if component["type"] in ("prefill", "decode") else "agg"
            assert config.disaggregation_mode.value == expected, where
            assert config.health_prober, (
                where
            )  # out of rotation while vLLM is not serving (docs/reference/worker.md#out-of-rotation-while-vllm-is-not-serving)


def test_deploy_disagg_pairs_a_prefill_and_a_decode_worker():
    (graph,) = _documents(DEPLOY / "disagg.yaml")
    modes = sorted(_option(_argv(_main(c)), "--disaggregation-mode") for c in _workers(graph))
    assert modes == ["decode", "prefill"]
    roles = {
        _option(_argv(_main(c)), "--disaggregation-mode"): json.loads(_option(_argv(_vllm(c)), "--kv-transfer-config"))[
            "kv_role"
        ]
        for c in _workers(graph)
    }
    assert roles == {"prefill": "kv_producer", "decode": "kv_consumer"}


def test_deploy_dockerfile_installs_the_wheel_with_dynamo_and_mock_on_a_slim_python_as_a_non_root_user():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    froms = [line.split()[1] for line in lines if line.startswith("FROM ")]
    assert froms and all(re.fullmatch(r"python:\$\{PYTHON_VERSION\}-slim(-\w+)?", f) for f in froms), froms
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users, "no USER instruction"
    assert users[-1].split(":")[0] not in ("root", "0"), users
    assert re.search(r"pip wheel .*--no-deps", text)
    assert re.search(r'pip install "\$\(ls /wheels/trio_sidecar-\*\.whl\)\[dynamo,mock\]"', text)
    entry = next(line for line in lines if line.startswith("ENTRYPOINT "))
    assert json.loads(entry.split(" ", 1)[1]) == ["trio-sidecar"]
    # The manifests' main containers use this image's command.
    for _, graph in _graphs():
        for component in _workers(graph):
            assert _main(component)["image"].rsplit("/", 1)[-1].startswith("trio-sidecar:")


def test_deploy_doc_mentions_every_manifest_and_the_security_note():
    doc = (REPO / "docs" / "deployment.md").read_text()
    for path in MANIFESTS:
        assert f"deploy/{path.name}" in doc
    assert "unauthenticated" in doc
    assert "deploy/Dockerfile" in doc
    for script in ("agg.sh", "disagg.sh", "agg_kv_router.sh"):
        assert f"launch/{script}" in doc
