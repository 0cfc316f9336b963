"""Start, probe and stop a real vLLM 0.32 gRPC server (docs/reference/real-vllm.md#environment, docs/reference/real-vllm.md#starting-the-server, docs/reference/real-vllm.md#readiness, docs/reference/real-vllm.md#installation).

The environment comes from ``scripts/real-vllm.sh`` through two variables:
``TRIO_SIDECAR_REAL_VLLM_PYTHON`` (the provisioned venv's python) and ``TRIO_SIDECAR_REAL_VLLM_MODEL``
(the tiny random Llama). Servers listen on 127.0.0.1 only, on free ports chosen here, and are stopped
by PID: SIGTERM, then SIGKILL after a timeout; descendants that outlive the main process are killed by
PID too (never by name). Readiness and warm-up use grpcio's synchronous client because they run in
sync (session-scoped) fixtures, outside any Trio run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import psutil

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import inference_pb2

ENV_PYTHON = "TRIO_SIDECAR_REAL_VLLM_PYTHON"
ENV_MODEL = "TRIO_SIDECAR_REAL_VLLM_MODEL"
# Optional: copy every server log here before the private directory is removed.
ENV_LOG_DIR = "TRIO_SIDECAR_REAL_VLLM_LOG_DIR"
HOST = "127.0.0.1"
SERVED_MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 8
# Start -> ready is 21-27 s on an idle 2-core machine (docs/reference/real-vllm.md#readiness); other engineers' tests share the cores.
READY_TIMEOUT_S = 300.0
# The first request with logprobs took up to 16.5 s (docs/reference/real-vllm.md#readiness).
WARM_UP_TIMEOUT_S = 180.0
# The main process exits 2.0-2.5 s after SIGTERM (docs/reference/real-vllm.md#shutdown-and-engine-death).
STOP_TIMEOUT_S = 30.0
SERVICES = ("vllm.Control", "vllm.Inference")
READY_LOG_LINE = "gRPC server is ready to accept requests"
# (what, seconds) measured during the run; printed in the pytest terminal summary.
TIMINGS: list[tuple[str, float]] = []


@attrs.frozen
class RealVllmEnv:
    python: Path
    model: Path

    @property
    def venv_bin(self) -> Path:
        return self.python.parent

    @property
    def vllm_rs(self) -> Path:
        out = subprocess.run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        )
        return Path(out.stdout.strip()) / "vllm" / "vllm-rs"


def env_from_environ() -> RealVllmEnv | None:
    python, model = os.environ.get(ENV_PYTHON), os.environ.get(ENV_MODEL)
    if not python or not model:
        return None
    return RealVllmEnv(Path(python), Path(model))


def check_env(env: RealVllmEnv) -> None:
    if not os.access(env.python, os.X_OK):
        raise RuntimeError(f"{ENV_PYTHON}={env.python} is not an executable; run scripts/real-vllm.sh")
    if not (env.model / "config.json").is_file():
        raise RuntimeError(f"{ENV_MODEL}={env.model} has no config.json; run scripts/real-vllm.sh")


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def process_exited(pid: int) -> bool:
    """True when ``pid`` is gone or a zombie (state ``Z`` in /proc/PID/stat; ``kill -0`` can't tell)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    # The state follows the parenthesised command name, which may itself contain spaces or parens.
    state = stat[stat.rindex(")") + 2 :].split(" ", 1)[0]
    return state in ("Z", "X")


class RealVllmServer:
    """One running server process tree; ``launch`` is "python" (``vllm serve``) or "rust" (``vllm-rs serve``)."""

    def __init__(
        self,
        env: RealVllmEnv,
        *,
        launch: str = "python",
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
    ):
        """``extra_env`` is added to the server's environment last (``PYTHONPATH`` included, which is otherwise
        never inherited)."""
        self.env = env
        self.launch = launch
        self.http_port, self.grpc_port = free_ports(2)
        self.host = HOST
        self.workdir = Path(tempfile.mkdtemp(prefix="real-vllm-"))
        self.log_path = self.workdir / "server.log"
        common = [
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--host",
            HOST,
            "--port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            *extra_args,
        ]
        if launch == "python":
            argv = [str(env.venv_bin / "vllm"), "serve", str(env.model), *common]
        elif launch == "rust":
            argv = [str(env.vllm_rs), "serve", str(env.model), *common[:], "--python", str(env.python)]
        else:
            raise ValueError(f"unknown launch {launch!r}")
        self.argv = argv
        tmp = self.workdir / "tmp"
        tmp.mkdir()
        child_env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        child_env.update(
            PATH=f"{env.venv_bin}{os.pathsep}{child_env.get('PATH', '')}",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            NO_COLOR="1",
            TMPDIR=str(tmp),
            VLLM_USE_RUST_FRONTEND="1",
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE="1",
            # vLLM's CPU worker pins its OpenMP thread to a core by default; on a 2-core machine shared with the
            # sidecar and the tests, the pinned worker then starves the processes that forward its outputs, and
            # most streams arrive whole at their end (docs/reference/real-vllm.md#abort-and-cancellation).
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            # Keep vLLM's own caches next to the provisioned venv, not in the user's home.
            VLLM_CACHE_ROOT=str(env.python.parent.parent.parent / "vllm-cache"),
        )
        child_env.update(extra_env or {})
        self._log = open(self.log_path, "wb")
        self.started_at = time.monotonic()
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=self.workdir,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.ready_after_s: float | None = None
        # Distinct health-check outcomes seen by wait_ready(), in order ("connection refused", "UNAVAILABLE", ...).
        self.startup_outcomes: list[str] = []
        self._descendants: dict[int, psutil.Process] = {}

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def __repr__(self) -> str:
        state = "exited" if self.popen.poll() is not None else "running"
        return f"<RealVllmServer {self.launch} pid={self.pid} grpc={self.endpoint} {state}>"

    # -- logs ------------------------------------------------------------------------------------------

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def find_in_log(self, pattern: str, offset: int = 0) -> re.Match[str] | None:
        return re.search(pattern, self.log_since(offset))

    # -- process tree ----------------------------------------------------------------------------------

    def remember_descendants(self) -> None:
        """Record the current process tree so that stop() can check every member by PID."""
        try:
            for p in psutil.Process(self.pid).children(recursive=True):
                self._descendants.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def descendants(self) -> list[psutil.Process]:
        self.remember_descendants()
        return list(self._descendants.values())

    def exited(self) -> bool:
        return self.popen.poll() is not None

    # -- readiness -------------------------------------------------------------------------------------

    def _observe(self, outcome: str) -> None:
        if not self.startup_outcomes or self.startup_outcomes[-1] != outcome:
            self.startup_outcomes.append(outcome)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        """Block until health ``Check`` reports SERVING on both services (docs/reference/real-vllm.md#readiness); returns the seconds taken."""
        import grpc

        deadline = self.started_at + timeout
        last = "no answer yet"
        with grpc.insecure_channel(self.endpoint) as channel:
            check = channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            pending = list(SERVICES)
            while pending:
                if self.exited():
                    raise RuntimeError(
                        f"vLLM exited with {self.popen.returncode} before becoming ready; log tail:\n{self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM not SERVING after {timeout}s ({last}); log tail:\n{self.log_tail()}")
                try:
                    status = check(health_pb2.HealthCheckRequest(service=pending[0]), timeout=5).status
                except grpc.RpcError as e:  # UNAVAILABLE / DEADLINE_EXCEEDED until the engine is up
                    last = f"{pending[0]}: {e.code().name} {e.details()}"
                    refused = "refused" in (e.details() or "").lower()
                    self._observe("connection refused" if refused else e.code().name)
                    time.sleep(0.5)
                    continue
                self._observe(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
                if status == health_pb2.HealthCheckResponse.SERVING:
                    pending.pop(0)
                else:
                    last = f"{pending[0]}: status {status}"
                    time.sleep(0.5)
        self.ready_after_s = time.monotonic() - self.started_at
        self.remember_descendants()
        return self.ready_after_s

    def warm_up(self, timeout: float = WARM_UP_TIMEOUT_S) -> float:
        """The warm-up (docs/reference/real-vllm.md#readiness): one GenerateStream with output logprobs, prompt logprobs and candidates."""
        import grpc

        request = inference_pb2.GenerateRequest(
            request_id="warm-up",
            token_ids=inference_pb2.TokenIds(ids=[5, 6, 7, 8]),
            temperature=0.0,
            stopping=inference_pb2.StoppingCriteria(max_new_tokens=4),
            response=inference_pb2.ResponseOptions(
                output_token_ids=True,
                output_logprobs=True,
                prompt_logprobs=True,
                output_candidates=inference_pb2.CandidateTokens(top_n=2),
                prompt_candidates=inference_pb2.CandidateTokens(top_n=2),
            ),
        )
        t0 = time.monotonic()
        with grpc.insecure_channel(self.endpoint) as channel:
            stream = channel.unary_stream(
                "/vllm.Inference/GenerateStream",
                request_serializer=inference_pb2.GenerateRequest.SerializeToString,
                response_deserializer=inference_pb2.GenerateResponse.FromString,
            )
            messages = list(stream(request, timeout=timeout))
        if not messages or not messages[-1].outputs.HasField("finish_info"):
            raise RuntimeError(f"warm-up stream ended without a terminal response: {messages!r}")
        return time.monotonic() - t0

    # -- shutdown --------------------------------------------------------------------------------------

    def terminate(self) -> None:
        """Send SIGTERM to the main process only (graceful shutdown, docs/reference/real-vllm.md#shutdown-and-engine-death)."""
        self.remember_descendants()
        if not self.exited():
            os.kill(self.pid, signal.SIGTERM)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> float:
        """SIGTERM, then SIGKILL after ``timeout``; reap; kill surviving descendants by PID.

        Returns the seconds the main process took to exit. Idempotent.
        """
        t0 = time.monotonic()
        try:
            self.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(10)
            took = time.monotonic() - t0
            # Descendants are reparented when the main process exits; give them a moment, then force.
            deadline = time.monotonic() + 10
            for proc in self._descendants.values():
                while not process_exited(proc.pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if not process_exited(proc.pid):
                    try:
                        if proc.is_running():  # same PID *and* same create time: still ours
                            proc.kill()
                    except psutil.NoSuchProcess:
                        pass
            return took
        finally:
            self._log.close()

    def leftovers(self) -> list[int]:
        """PIDs of the process tree still alive (not zombies) after stop(); should be empty."""
        alive = []
        for proc in self.descendants():
            if not process_exited(proc.pid):
                try:
                    if proc.is_running():
                        alive.append(proc.pid)
                except psutil.NoSuchProcess:
                    pass
        return alive

    def cleanup_files(self) -> None:
        """Remove the server's private directory (log and TMPDIR); keep the log if asked (CI artifacts)."""
        keep = os.environ.get(ENV_LOG_DIR)
        if keep and self.log_path.exists():
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(self.log_path, Path(keep) / f"vllm-{self.launch}-{self.pid}.log")
        shutil.rmtree(self.workdir, ignore_errors=True)


class AttachedServer(RealVllmServer):
    """A server started outside the test run (developer iteration: ``TRIO_SIDECAR_REAL_VLLM_ATTACH``).

    The value is ``PORT:LOG_PATH`` (or ``PORT,HTTP_PORT:LOG_PATH``, for the tests that also use vLLM's
    OpenAI HTTP server) of a server started with this module's settings; it is never stopped.
    """

    def __init__(self, env: RealVllmEnv, spec: str):  # not calling super().__init__: it would start a process
        ports, log = spec.split(":", 1)
        port, _, http_port = ports.partition(",")
        self.env, self.launch, self.host, self.grpc_port = env, "attached", HOST, int(port)
        self.http_port = int(http_port) if http_port else None
        self.log_path = Path(log)
        self.pid = -1
        self.ready_after_s = 0.0
        self.startup_outcomes = []
        self.started_at = time.monotonic()
        self._descendants = {}

    def __repr__(self) -> str:
        return f"<AttachedServer grpc={self.endpoint}>"

    def exited(self) -> bool:
        return False

    def remember_descendants(self) -> None:
        pass

    def terminate(self) -> None:
        raise RuntimeError("an attached server is never stopped by the tests")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> float:
        return 0.0

    def cleanup_files(self) -> None:
        pass


def start_ready_server(
    env: RealVllmEnv, *, launch: str = "python", warm_up: bool = True, extra_args: tuple[str, ...] = ()
) -> RealVllmServer:
    """Start a server and wait for readiness (+ warm-up); on failure, stop it and re-raise."""
    check_env(env)
    server = RealVllmServer(env, launch=launch, extra_args=extra_args)
    try:
        server.wait_ready()
        if warm_up:
            server.warm_up()
    except BaseException:
        server.stop()
        sys.stderr.write(f"real vLLM log ({server.log_path}):\n{server.log_tail(80)}\n")
        server.cleanup_files()
        raise
    return server
