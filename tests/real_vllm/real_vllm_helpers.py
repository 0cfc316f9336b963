"""Request builders and stream collectors shared by the real-vLLM tests."""

from __future__ import annotations

import re
import time
import uuid

import attrs
import trio
from real_vllm_client import rpc_error_types

from trio_sidecar._proto.vllm import inference_pb2

GENERATE_STREAM = "/vllm.Inference/GenerateStream"
GENERATE = "/vllm.Inference/Generate"
ABORT = "/vllm.Control/Abort"
PROMPT = (5, 6, 7, 8)
CALL_TIMEOUT_S = 120.0


# Cancellation races (docs/reference/real-vllm.md#abort-and-cancellation): a 252-token stream takes 0.3-0.8 s, and under CPU contention vLLM sometimes
# sends a stream's first message only together with most of its tokens (seen with grpcio clients too), so a
# cancel sent "right after the first message" can land after the end. Such attempts are retried with a
# fresh request id until this deadline; the losing streaks are correlated, hence a deadline, not a count.
RACE_DEADLINE_S = 90.0


def race_attempts(deadline_s: float = RACE_DEADLINE_S, min_attempts: int = 5):
    """Attempt numbers for a ``for ... else: pytest.fail(...)`` retry loop (sleep 0.2 s between attempts)."""
    start = time.monotonic()
    n = 0
    while n < min_attempts or time.monotonic() - start < deadline_s:
        yield n
        n += 1


def unique_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def generate_request(
    request_id: str,
    *,
    prompt=PROMPT,
    max_new_tokens: int = 8,
    logprobs: bool = False,
    top_n: int | None = None,
    prompt_logprobs: bool = False,
    ignore_eos: bool = True,
    **fields,
) -> inference_pb2.GenerateRequest:
    """A greedy token-ID request in the shape of docs/reference/real-vllm.md#inference-stream."""
    response = inference_pb2.ResponseOptions(
        output_token_ids=True, output_logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )
    if top_n is not None:
        response.output_candidates.top_n = top_n
    if prompt_logprobs:
        response.prompt_token_ids = True
    return inference_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=inference_pb2.TokenIds(ids=list(prompt)),
        temperature=0.0,
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos),
        response=response,
        **fields,
    )


@attrs.define
class Outcome:
    """What one GenerateStream call produced: messages, then either OK or an error (and where)."""

    messages: list = attrs.Factory(list)
    error: BaseException | None = None
    phase: str = "ok"  # "ok", "open" (raised entering the stream), "stream" (raised while iterating)

    @property
    def code(self):
        return None if self.error is None else self.error.code

    @property
    def message(self) -> str | None:
        return None if self.error is None else self.error.message

    def tokens(self) -> list[int]:
        return [t for m in self.messages for t in m.outputs.token_ids]

    def terminal(self):
        finals = [m.outputs.finish_info for m in self.messages if m.outputs.HasField("finish_info")]
        assert len(finals) == 1, f"expected exactly one terminal, got {len(finals)}: {self.messages!r}"
        return finals[0]


async def collect(channel, request, *, metadata=(), method=GENERATE_STREAM, response_type=None) -> Outcome:
    """Run one server-streaming call to the end, recording messages and the final status."""
    response_type = response_type or inference_pb2.GenerateResponse
    out = Outcome()
    errors = rpc_error_types()
    with trio.fail_after(CALL_TIMEOUT_S + 10):
        try:
            async with channel.unary_stream(
                method, request, response_type, metadata=metadata, timeout=CALL_TIMEOUT_S
            ) as stream:
                out.phase = "stream"
                async for message in stream:
                    out.messages.append(message)
                out.phase = "ok"
        except errors as e:
            out.error = e
            if out.phase != "stream":
                out.phase = "open"
    return out


def closed_pattern(request_id: str) -> str:
    return rf'request_id={re.escape(request_id)} rpc="GenerateStream"[^\n]*gRPC inference stream closed'


async def drop_outcome(server, request_id: str, *, offset: int = 0, timeout: float = 20.0) -> str:
    """After a stream was abandoned: "aborted" (the server's auto-abort line) or "finished" (it completed
    before the reset arrived, the race (docs/reference/real-vllm.md#abort-and-cancellation); the caller retries)."""
    aborted = auto_abort_pattern(request_id)
    closed = closed_pattern(request_id)
    with trio.move_on_after(timeout):
        while True:
            text = server.log_since(offset)
            if re.search(aborted, text):
                return "aborted"
            if re.search(closed, text):
                return "finished"
            await trio.sleep(0.1)
    raise AssertionError(f"no outcome for dropped stream {request_id} within {timeout}s; tail:\n{server.log_tail(20)}")


def auto_abort_pattern(request_id: str) -> str:
    # docs/reference/real-vllm.md#abort-and-cancellation: the server appends "-<8 hex>" to the external id in its logs.
    return rf'auto-aborting request due to dropped stream request_id="{re.escape(request_id)}-[0-9a-f]{{8}}"'
