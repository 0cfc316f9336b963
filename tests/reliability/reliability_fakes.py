"""Helpers for the reliability suite.

* ``ScriptedInference``: a fake vLLM (Health + Control + Inference on the project's ``serve_grpc``, bound to
  127.0.0.1:0) whose ``GenerateStream`` answer is chosen by the request id's prefix. Used for the malformed
  response scenarios (test_malformed_responses.py).
* ``Outcome`` / ``drive``: run one request through a sidecar and record exactly what came out, so every
  scenario can assert the suite's invariant: each accepted request ends with exactly one terminal chunk or
  exactly one typed error.
* ``MockProcess``: ``python -m trio_sidecar mock`` as a subprocess (killed by PID, restartable on its port).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence

import attrs
import fakes
import trio

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import control_grpc, control_pb2, inference_grpc, inference_pb2
from trio_sidecar.core.errors import SidecarError

SERVING = health_pb2.HealthCheckResponse.SERVING
PROMPT = [1, 2, 3]
FinishReason = inference_pb2.FinishInfo.FinishReason


# --- outcome bookkeeping ----------------------------------------------------------------------------------


@attrs.define
class Outcome:
    """What one request produced. ``terminals`` counts chunks with a ``finish_reason``."""

    request_id: str
    chunks: list = attrs.Factory(list)
    error: BaseException | None = None
    admitted: bool = False
    after_terminal: int = 0  # chunks after the terminal one (must stay 0)

    @property
    def terminals(self) -> int:
        return sum(1 for chunk in self.chunks if chunk.finish_reason is not None)

    @property
    def tokens(self) -> list[int]:
        return [token for chunk in self.chunks for token in chunk.token_ids]

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1].finish_reason if self.chunks else None

    def check_invariant(self) -> None:
        """Exactly one terminal chunk and no error, or no terminal and exactly one typed error."""
        assert self.after_terminal == 0, f"{self.request_id}: chunks after the terminal"
        if self.error is None:
            assert self.terminals == 1, f"{self.request_id}: {self.terminals} terminals and no error"
        else:
            assert isinstance(self.error, SidecarError), f"{self.request_id}: untyped {self.error!r}"
            assert self.terminals == 0, f"{self.request_id}: a terminal chunk and an error"


async def drive(
    sidecar,
    request: dict,
    request_id: str,
    *,
    on_chunk: Callable | None = None,
) -> Outcome:
    """Run one request to its end; typed errors are recorded, everything else propagates."""
    from trio_sidecar.api import GenerateContext

    outcome = Outcome(request_id)
    try:
        async with sidecar.generate(request, GenerateContext(request_id)) as chunks:
            outcome.admitted = True
            async for chunk in chunks:
                if outcome.terminals:
                    outcome.after_terminal += 1
                outcome.chunks.append(chunk)
                if on_chunk is not None:
                    await on_chunk(outcome, chunk)
    except SidecarError as exc:
        outcome.error = exc
    return outcome


def check_all(outcomes: Sequence[Outcome], expected: int) -> None:
    assert len(outcomes) == expected, f"{expected - len(outcomes)} requests never finished"
    assert len({o.request_id for o in outcomes}) == expected
    for outcome in outcomes:
        outcome.check_invariant()


# --- the scripted fake vLLM --------------------------------------------------------------------------------


def model_info() -> control_pb2.ModelInfo:
    return fakes.model_info(model_id="org/fake", served_model_name="fake-model")


def server_info() -> control_pb2.ServerInfo:
    return fakes.server_info(instance_id="fake-1", max_running_requests=64)


def token(
    token_id: int = 42, *, finish: inference_pb2.FinishInfo | None = None, **fields
) -> inference_pb2.GenerateResponse:
    out = dict(index=0, text=" token", num_tokens=1, token_ids=[token_id])
    out.update(fields)
    if finish is not None:
        out["finish_info"] = finish
    return inference_pb2.GenerateResponse(outputs=inference_pb2.SequenceOutput(**out))


def prompt_info(n: int = len(PROMPT), **fields) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(prompt_info=inference_pb2.PromptInfo(num_prompt_tokens=n, **fields))


def finish(count: int, reason: int = FinishReason.STOP, **fields) -> inference_pb2.FinishInfo:
    return inference_pb2.FinishInfo(num_output_tokens=count, finish_reason=reason, **fields)


def nan_struct():
    from google.protobuf import struct_pb2

    struct = struct_pb2.Struct()
    struct.fields["remote_block_ids"].number_value = math.nan
    return struct


def _candidates(n: int) -> list[inference_pb2.CandidateTokenInfo]:
    info = inference_pb2.CandidateTokenInfo
    return [info(tokens=[info.TokenInfo(id=43, logprob=-0.5, rank=2)]) for _ in range(n)]


def good_stream(n_tokens: int = 1) -> list[inference_pb2.GenerateResponse]:
    messages = [prompt_info()]
    for i in range(n_tokens - 1):
        messages.append(token(100 + i))
    messages.append(token(100 + n_tokens - 1, finish=finish(n_tokens)))
    return messages


#: request-id prefix → (the response messages, the protocol-error detail the sidecar must raise).
#: Each script violates one docs/reference/sidecar.md#per-message-checks and docs/reference/sidecar.md#stream-level-rules rule; ``REQUEST_OPTIONS`` gives the request's ``output_options``.
MALFORMED: dict[str, tuple[list[inference_pb2.GenerateResponse], str]] = {
    "prompt-count": ([prompt_info(4)], "prompt token count 4 does not match request count 3"),
    "prompt-logprobs": (
        [prompt_info(token_ids=PROMPT, logprobs=[-0.1, -0.2], ranks=[1, 1, 1], candidate_tokens=_candidates(3))],
        "prompt logprob array lengths do not match expected count 3: "
        "token_ids=3, logprobs=2, ranks=3, candidate_tokens=3",
    ),
    "sequence-index": ([prompt_info(), token(index=1)], "received unsupported sequence index 1"),
    "num-tokens": ([prompt_info(), token(num_tokens=2)], "num_tokens 2 does not match 1 token IDs"),
    "output-logprobs": (
        [prompt_info(), token(logprobs=[], ranks=[1], candidate_tokens=_candidates(1))],
        "output logprob array lengths do not match expected count 1: "
        "token_ids=1, logprobs=0, ranks=1, candidate_tokens=1",
    ),
    "terminal-count": (
        [prompt_info(), token(), token(finish=finish(5))],
        "terminal num_output_tokens 5 does not match streamed count 2",
    ),
    "not-finished": (
        [prompt_info(), token(finish=finish(1, FinishReason.NOT_FINISHED))],
        "terminal response has NOT_FINISHED finish reason",
    ),
    "unknown-finish": ([prompt_info(), token(finish=finish(1, 9))], "unknown finish reason 9"),
    "nan-struct": (
        [prompt_info(), token(finish=finish(1, kv_transfer_params=nan_struct()))],
        "NaN or infinity",
    ),
    "early-eof": ([prompt_info(), token()], "GenerateStream ended before a terminal response"),
}


def kv_struct():
    from google.protobuf import struct_pb2

    struct = struct_pb2.Struct()
    struct.update({"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_block_ids": [7, 8]})
    return struct


def _prefill_terminal() -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(
        outputs=inference_pb2.SequenceOutput(
            index=0, num_tokens=0, finish_info=finish(0, FinishReason.LENGTH, kv_transfer_params=kv_struct())
        )
    )


#: Multimodal prefill violations (docs/reference/sidecar.md#multimodal-requests): vLLM's expanded prompt ids are missing or inconsistent.
PREFILL_MALFORMED: dict[str, tuple[list[inference_pb2.GenerateResponse], str]] = {
    "mm-no-ids": (
        [prompt_info(20), _prefill_terminal()],
        "multimodal prefill did not return expanded prompt token IDs",
    ),
    "mm-bad-ids": (
        [prompt_info(20, token_ids=list(range(19))), _prefill_terminal()],
        "multimodal prefill returned 19 prompt token IDs for 20 prompt tokens",
    ),
    "prefill-no-kv": (
        [
            prompt_info(),
            inference_pb2.GenerateResponse(
                outputs=inference_pb2.SequenceOutput(index=0, num_tokens=0, finish_info=finish(0, FinishReason.LENGTH))
            ),
        ],
        "prefill terminal is missing kv_transfer_params",
    ),
}

IMAGE = {"image_url": [{"Url": "data:image/png;base64,iVBORw0KGgo="}]}

REQUEST_OPTIONS: dict[str, dict] = {
    "prompt-logprobs": {"prompt_logprobs": 1},
    "output-logprobs": {"logprobs": 1},
}


def request_for(kind: str, *, max_tokens: int = 8) -> dict:
    request = {
        "token_ids": list(PROMPT),
        "stop_conditions": {"max_tokens": max_tokens},
        "output_options": REQUEST_OPTIONS.get(kind, {}),
    }
    if kind.startswith("mm-"):
        request["multi_modal_data"] = IMAGE
    return request


class _Control(control_grpc.ControlServicer):
    def __init__(self) -> None:
        self.model_info = model_info()
        self.server_info = server_info()
        self.aborts: list[list[str]] = []

    async def GetModelInfo(self, request, context):
        return self.model_info

    async def GetServerInfo(self, request, context):
        return self.server_info

    async def GetKvEventSources(self, request, context):
        return control_pb2.GetKvEventSourcesResponse()

    async def Abort(self, request, context):
        self.aborts.append(list(request.request_ids))
        return control_pb2.AbortResponse()


class _Inference(inference_grpc.InferenceServicer):
    def __init__(self, fake: ScriptedInference) -> None:
        self.fake = fake

    async def GenerateStream(self, request, context):
        fake = self.fake
        fake.requests[request.request_id] = request
        fake.active += 1
        fake.started[request.request_id] = trio.current_time()
        try:
            messages, delay = fake.script_for(request.request_id)
            for message in messages:
                if delay:
                    await trio.sleep(delay)
                yield message
            # The server keeps the stream open after a violation so that only the sidecar can drop it.
            kind = request.request_id.split("/")[0]
            if (kind in MALFORMED or kind in PREFILL_MALFORMED) and kind != "early-eof":
                await trio.sleep_forever()
        finally:
            fake.active -= 1
            fake.ended[request.request_id] += 1


class ScriptedInference:
    """Health + Control + a scripted ``GenerateStream`` (script chosen by ``request_id`` prefix)."""

    def __init__(self) -> None:
        from trio_sidecar.transport import HealthServicer

        self.health = HealthServicer({"": SERVING, "vllm.Control": SERVING, "vllm.Inference": SERVING})
        self.control = _Control()
        self.inference = _Inference(self)
        self.requests: dict[str, inference_pb2.GenerateRequest] = {}
        self.started: dict[str, float] = {}
        self.ended: Counter[str] = Counter()
        self.active = 0
        self.server = None

    def script_for(self, request_id: str) -> tuple[list[inference_pb2.GenerateResponse], float]:
        kind, _, rest = request_id.partition("/")
        if kind in MALFORMED:
            return MALFORMED[kind][0], 0.0
        if kind in PREFILL_MALFORMED:
            return PREFILL_MALFORMED[kind][0], 0.0
        if kind == "slow":  # slow/<n>: n tokens, 20 ms apart
            return good_stream(int(rest.split("/")[0])), 0.02
        return good_stream(3), 0.0

    async def serve(self, nursery: trio.Nursery) -> int:
        from trio_sidecar.transport import serve_grpc

        self.server = await nursery.start(
            lambda task_status: serve_grpc(
                [self.health, self.control, self.inference], host="127.0.0.1", port=0, task_status=task_status
            )
        )
        return self.server.port


# --- the mock as a subprocess ------------------------------------------------------------------------------


class MockProcess:
    """``python -m trio_sidecar mock`` on 127.0.0.1; killed by its PID, restartable on the same port."""

    def __init__(self, args: Sequence[str], log_path: os.PathLike) -> None:
        self.args = list(args)
        self.log_path = log_path
        self.port = 0
        self.process: trio.Process | None = None
        self.starts = 0

    async def start(self, *, timeout: float = 60.0) -> int:
        assert self.process is None
        command = [sys.executable, "-m", "trio_sidecar", "mock", "--listen", f"127.0.0.1:{self.port}", *self.args]
        log = open(self.log_path, "ab")  # noqa: SIM115, ASYNC230 - handed to the child; opening a local file does not block
        try:
            self.process = await trio.lowlevel.open_process(
                command, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()
        self.starts += 1
        line = b""
        with trio.fail_after(timeout):
            while not line.endswith(b"\n"):
                data = await self.process.stdout.receive_some(1)
                if not data:
                    raise RuntimeError(f"mock exited before listening; see {self.log_path}")
                line += data
        text = line.decode().strip()
        prefix = "trio-sidecar mock listening on "
        assert text.startswith(prefix), text
        self.port = int(text.rsplit(":", 1)[1])
        return self.port

    async def kill(self) -> None:
        """SIGKILL (no graceful shutdown: connections just drop)."""
        assert self.process is not None
        self.process.kill()
        await self.process.wait()
        await self._release()

    async def terminate(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(10):
            code = await self.process.wait()
        if self.process.returncode is None:
            self.process.kill()
            code = await self.process.wait()
        await self._release()
        return code

    async def _release(self) -> None:
        assert self.process is not None
        if self.process.stdout is not None:
            await self.process.stdout.aclose()
        self.process = None

    async def aclose(self) -> None:
        if self.process is not None:
            with trio.CancelScope(shield=True):
                await self.kill()


# --- the in-process mock + a sidecar on it ------------------------------------------------------------------

#: docs/reference/mock.md#in-process-api-and-test-hooks "admitting args", instant timing.
FAST_ENGINE_ARGS = {
    "block_size": 4,
    "enable_prefix_caching": False,
    "num_gpu_blocks": 4096,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 1024,
    "speedup_ratio": 0.0,
}


def sidecar_config(address: str, **overrides):
    # generous: a first Watch status may be slow on a loaded machine
    return fakes.sidecar_config(address, **{"connect_attempt_timeout": 15.0, "startup_deadline": 30.0, **overrides})


def mock_config(*, engine_args: dict | None = None, **overrides):
    from trio_sidecar.mock import MockConfig

    fields = dict(listen="127.0.0.1:0", model="mocker-model", engine_args=dict(engine_args or FAST_ENGINE_ARGS))
    fields.update(overrides)
    return MockConfig(**fields)


def mock_idle(mock) -> bool:
    """The mock's live counters are all back to zero."""
    if mock.active_request_count() != 0:
        return False
    metrics = mock.metrics(0)
    return metrics.running_requests == 0 and metrics.waiting_requests == 0


def sidecar_in_flight(sidecar) -> int:
    """The sidecar's in-flight request count (0 when idle)."""
    return sidecar.engine.in_flight


wait_until = fakes.wait_until


def mock_request(max_tokens: int, prompt: Sequence[int] = (11, 22, 33, 44), **options) -> dict:
    return {
        "token_ids": list(prompt),
        "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True},
        "sampling_options": {"temperature": 0.0},
        **options,
    }
