"""The request task's batch builder (core/convert/batch.py): per-message decisions, compact batches, endings.

Table-driven: each case feeds a message script to a ``BatchBuilder`` the way a paced consumer would
(take the open batch after every ``END`` and whenever the script says the transport had nothing more
buffered) and compares the chunks handed over, the ending and the usage. ``test_property.py`` checks the
same against converting one message at a time, on random streams.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.config import DisaggregationMode
from trio_sidecar.core.convert import ResponseState, build_generate_request
from trio_sidecar.core.convert.batch import (
    END,
    EOF_BEFORE_TERMINAL,
    MORE,
    WARN_CONVERSION_AFTER_CANCEL,
    WARN_EOF_AFTER_CANCEL,
    WARN_ERROR_AFTER_CANCEL,
    BatchBuilder,
    ChunkBatch,
    deliver_items,
)
from trio_sidecar.core.errors import ProtocolError, UnknownError
from trio_sidecar.core.multimodal import HANDOFF_KEY
from trio_sidecar.core.protocol import LLMEngineOutput, structure_request, token_chunk, token_chunk_dict

AGG, PREFILL, DECODE = DisaggregationMode.AGG, DisaggregationMode.PREFILL, DisaggregationMode.DECODE
STOP, LENGTH = 2, 1
FLUSH = "flush"  # in a script: the transport had nothing more buffered here (the task hands the batch over)


def state(mode: DisaggregationMode = AGG, **options: Any) -> ResponseState:
    req: dict[str, Any] = {"token_ids": [1, 2, 3], "output_options": options}
    if mode is DECODE:
        req["prefill_result"] = {"disaggregated_params": {HANDOFF_KEY: [1, 2, 3, 4]}}
    request = structure_request(req)
    return ResponseState(request, build_generate_request(request, "r", "m", mode), mode)


def out(
    tokens: list[int],
    *,
    text: str = "",
    num: int | None = None,
    index: int = 0,
    finish: int | None = None,
    info: int | None = None,
    logprobs: list[float] | None = None,
) -> pb.GenerateResponse:
    seq = pb.SequenceOutput(index=index, text=text, num_tokens=len(tokens) if num is None else num, token_ids=tokens)
    if logprobs is not None:
        seq.logprobs.extend(logprobs)
        seq.ranks.extend([1] * len(logprobs))
        seq.candidate_tokens.extend([pb.CandidateTokenInfo()] * len(logprobs))
    if finish is not None:
        seq.finish_info.CopyFrom(pb.FinishInfo(num_output_tokens=finish, finish_reason=STOP))
    resp = pb.GenerateResponse(outputs=seq)
    if info is not None:
        resp.prompt_info.CopyFrom(pb.PromptInfo(num_prompt_tokens=info))
    return resp


def prompt(n: int = 3) -> pb.GenerateResponse:
    return pb.GenerateResponse(prompt_info=pb.PromptInfo(num_prompt_tokens=n))


def fields(chunk: LLMEngineOutput) -> dict[str, Any]:
    return chunk.to_dict()


def run(builder: BatchBuilder, script: list[Any], request_cancelled: bool = False) -> tuple[list[list[dict]], list]:
    """Feed ``script``; returns the batches handed over (as chunk dicts) and the steps."""
    batches: list[list[dict]] = []
    steps = []

    def hand_over() -> None:
        items = builder.take_items()
        if items is not None:
            batch = ChunkBatch(items)
            taken = []
            while (chunk := batch.take()) is not None:
                taken.append(fields(chunk))
            batches.append(taken)

    for item in script:
        if item == FLUSH:
            hand_over()
            continue
        step = builder.add(item.SerializeToString(), request_cancelled)
        steps.append(step)
        if step is END:
            hand_over()
            break
    else:
        hand_over()
    return batches, steps


def usage(chunk: LLMEngineOutput) -> tuple[int, int]:
    assert chunk.completion_usage is not None
    return chunk.completion_usage.prompt_tokens, chunk.completion_usage.completion_tokens


def tok(token: int, text: str = "a") -> dict[str, Any]:
    return {"token_ids": [token], "index": 0, "text": text}


# ------------------------------------------------------------------- batches of ordinary messages

CASES = [
    # (name, mode, options, script, batches, steps)
    (
        "plain tokens batch until the transport runs dry",
        AGG,
        {},
        [out([7], text="a"), out([8], text="a"), FLUSH, out([9], text="a")],
        [[tok(7), tok(8)], [tok(9)]],
        [MORE, MORE, MORE],
    ),
    (
        "several tokens in one message, no text: text is the empty string",
        AGG,
        {},
        [out([7, 300, 70000])],
        [[{"token_ids": [7, 300, 70000], "index": 0, "text": ""}]],
        [MORE],
    ),
    (
        "silent messages add nothing",
        AGG,
        {},
        [prompt(), pb.GenerateResponse(), out([]), FLUSH],
        [],
        [MORE, MORE, MORE],
    ),
    (
        "prompt info with a token takes the checked path and joins the batch",
        AGG,
        {},
        [out([7], text="a"), out([8], text="a", info=3), out([9], text="a")],
        [[tok(7), tok(8), tok(9)]],
        [MORE, MORE, MORE],
    ),
    (
        "logprob chunks are batched too",
        AGG,
        {"logprobs": 0},
        [out([7], text="a", logprobs=[-0.5]), out([8], logprobs=[-1e9])],
        [[{**tok(7), "log_probs": [-0.5]}, {**tok(8, ""), "log_probs": [-9999.0]}]],
        [MORE, MORE],
    ),
    (
        "prefill streams nothing before its terminal",
        PREFILL,
        {},
        [prompt(), out([7], text="a"), FLUSH],
        [],
        [MORE, MORE],
    ),
    (
        "decode: silent messages before the transfer, then the first token opens the batch",
        DECODE,
        {},
        [prompt(), out([]), out([7], text="a"), out([8], text="a")],
        [[tok(7), tok(8)]],
        [MORE, MORE, MORE, MORE],
    ),
]


@pytest.mark.parametrize(
    ("mode", "options", "script", "batches", "steps"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_ordinary_messages_are_batched(mode, options, script, batches, steps) -> None:
    st = state(mode, **options)
    builder = BatchBuilder(st, decode=mode is DECODE)
    got_batches, got_steps = run(builder, script)
    assert got_batches == batches
    assert got_steps == steps
    assert builder.ending is None
    assert st.completion_tokens == sum(len(c["token_ids"]) for b in batches for c in b) or mode is PREFILL


# ------------------------------------------------------------------- endings

ENDINGS = [
    # (name, mode, cancelled, script, batches before the end, ending fields, usage of final)
    (
        "terminal ends after the batch before it",
        AGG,
        False,
        [out([7], text="a"), out([8], text="a"), out([9], finish=3)],
        [[tok(7), tok(8)]],
        {"server_ended": True, "finish_reason": "stop", "error": None, "warning": None},
        (3, 3),
    ),
    (
        "conversion error: the server did not end the stream",
        AGG,
        False,
        [out([7], text="a"), out([8], index=1)],
        [[tok(7)]],
        {
            "server_ended": False,
            "error": "invalid vLLM gRPC response: received unsupported sequence index 1",
            "warning": None,
        },
        None,
    ),
    (
        "a count error at the terminal counted its tokens first",
        AGG,
        False,
        [out([7]), out([8, 9], finish=5)],
        [[tok(7, "")]],
        {
            "server_ended": False,
            "error": "invalid vLLM gRPC response: terminal num_output_tokens 5 does not match streamed count 3",
        },
        None,
    ),
    (
        "num_tokens mismatch",
        AGG,
        False,
        [out([7, 8], num=1)],
        [],
        {"server_ended": False, "error": "invalid vLLM gRPC response: num_tokens 1 does not match 2 token IDs"},
        None,
    ),
    (
        "num_tokens mismatch, several tokens",
        AGG,
        False,
        [out([7, 8], num=3)],
        [],
        {"server_ended": False, "error": "invalid vLLM gRPC response: num_tokens 3 does not match 2 token IDs"},
        None,
    ),
    (
        "decode, cancellation recorded: the first token's chunk becomes the cancelled chunk",
        DECODE,
        True,
        [out([]), out([7], text="a"), out([8])],
        [],
        {"server_ended": False, "finish_reason": "cancelled", "error": None},
        (3, 1),
    ),
    (
        "decode, cancellation recorded, the first message is the terminal",
        DECODE,
        True,
        [out([7], finish=1)],
        [],
        {"server_ended": True, "finish_reason": "cancelled"},
        (3, 1),
    ),
    (
        "decode, cancellation recorded, a finish without tokens",
        DECODE,
        True,
        [out([], finish=0)],
        [],
        {"server_ended": True, "finish_reason": "cancelled"},
        (3, 0),
    ),
    (
        "decode, cancellation recorded, conversion error: the cancelled chunk and a warning",
        DECODE,
        True,
        [out([7], index=2)],
        [],
        {"server_ended": False, "finish_reason": "cancelled", "warning": WARN_CONVERSION_AFTER_CANCEL, "error": None},
        (3, 0),
    ),
    (
        "decode without cancellation: the terminal as usual",
        DECODE,
        False,
        [out([7]), out([], finish=1)],
        [[tok(7, "")]],
        {"server_ended": True, "finish_reason": "stop"},
        (3, 1),
    ),
    (
        "prefill terminal",
        PREFILL,
        False,
        [prompt(), out([7], text="a"), out([], finish=1, text="")],
        [],
        {"server_ended": False, "error": "invalid vLLM gRPC response: prefill terminal is missing kv_transfer_params"},
        None,
    ),
]


@pytest.mark.parametrize(
    ("mode", "cancelled", "script", "batches", "expected", "final_usage"),
    [c[1:] for c in ENDINGS],
    ids=[c[0] for c in ENDINGS],
)
def test_endings(mode, cancelled, script, batches, expected, final_usage) -> None:
    builder = BatchBuilder(state(mode), decode=mode is DECODE)
    got_batches, steps = run(builder, script, request_cancelled=cancelled)
    assert got_batches == batches
    assert steps[-1] is END and all(step is MORE for step in steps[:-1])
    ending = builder.ending
    assert ending is not None
    got = attrs.asdict(ending, recurse=False)
    got["error"] = None if ending.error is None else str(ending.error)
    got["finish_reason"] = None if ending.final is None else ending.final.finish_reason
    assert {key: got[key] for key in expected} == expected
    if ending.error is not None:
        assert isinstance(ending.error, ProtocolError) and ending.final is None
    else:
        assert ending.final is not None and usage(ending.final) == final_usage


@pytest.mark.parametrize(
    ("mode", "cancelled", "error", "warning"),
    [
        (AGG, False, EOF_BEFORE_TERMINAL, None),
        (DECODE, False, EOF_BEFORE_TERMINAL, None),
        (DECODE, True, None, WARN_EOF_AFTER_CANCEL),
    ],
)
def test_eof(mode, cancelled, error, warning) -> None:
    builder = BatchBuilder(state(mode), decode=mode is DECODE)
    ending = builder.eof(cancelled)
    assert ending.server_ended and ending.warning == warning
    if error is None:
        assert ending.error is None and ending.final is not None and ending.final.finish_reason == "cancelled"
    else:
        assert str(ending.error) == "invalid vLLM gRPC response: " + error and ending.final is None


@pytest.mark.parametrize(("mode", "cancelled"), [(AGG, False), (DECODE, False), (DECODE, True)])
def test_a_message_that_does_not_parse_ends_with_the_transports_error_and_abandons_the_stream(mode, cancelled) -> None:
    builder = BatchBuilder(state(mode), decode=mode is DECODE)
    assert builder.add(prompt().SerializeToString(), cancelled) is MORE
    assert builder.add(b"\x12\x05\x18\x01\x22", cancelled) is END  # truncated
    ending = builder.ending
    assert ending is not None and not ending.server_ended
    if cancelled:
        assert ending.error is None and ending.warning == WARN_ERROR_AFTER_CANCEL
        assert ending.final is not None and ending.final.finish_reason == "cancelled"
    else:
        assert isinstance(ending.error, UnknownError) and ending.final is None
        assert str(ending.error) == (
            "GenerateStream: failed to parse a response message of /vllm.Inference/GenerateStream (Internal)"
        )


def test_transfer_completed_only_in_decode_mode_once_a_token_or_finish_arrived() -> None:
    agg = BatchBuilder(state(), decode=False)
    agg.add(out([7]).SerializeToString(), False)
    assert not agg.transfer_completed
    decode = BatchBuilder(state(DECODE), decode=True)
    for resp in (prompt(), out([])):
        decode.add(resp.SerializeToString(), False)
        assert not decode.transfer_completed
    decode.add(out([7]).SerializeToString(), False)
    assert decode.transfer_completed
    assert "deferring" not in repr(decode) and "1 chunks open" in repr(decode)


# ------------------------------------------------------------------- ChunkBatch


def test_chunk_batch_takes_drops_and_counts() -> None:
    built = LLMEngineOutput(token_ids=[5, 6], text="b", log_probs=[-1.0, -2.0])
    batch = ChunkBatch([1, "a", [2, 3, 4], "", built, None, 7, ""])
    assert len(batch) == 4 and batch.tokens() == 7
    first = batch.take()
    assert first == LLMEngineOutput(token_ids=[1], text="a")
    assert len(batch) == 3 and batch.tokens() == 6
    assert batch.take() == LLMEngineOutput(token_ids=[2, 3, 4], text="")
    assert batch.take() is built
    assert "1 of 4 chunks left" in repr(batch)
    assert batch.drop() == 1
    assert len(batch) == 0 and batch.take() is None and batch.drop() == 0


def deliver(items: list) -> list:
    got: list = []
    deliver_items(items, lambda ids, text: got.append(("tokens", ids, text)), lambda c: got.append(("chunk", c)))
    return got


def test_deliver_items_hands_over_what_chunk_batch_would_return_in_order() -> None:
    built = LLMEngineOutput(token_ids=[5, 6], text="b", log_probs=[-1.0, -2.0])
    items = [1, "a", built, None, [2, 3, 4], "", built, None, 7, ""]
    expected = []
    batch = ChunkBatch(list(items))
    while (chunk := batch.take()) is not None:
        expected.append(chunk)
    got = deliver(items)
    assert got == [
        ("tokens", [1], "a"),
        ("chunk", built),
        ("tokens", [2, 3, 4], ""),
        ("chunk", built),
        ("tokens", [7], ""),
    ]
    as_chunks = [token_chunk(g[1], g[2]) if g[0] == "tokens" else g[1] for g in got]
    assert as_chunks == expected


def test_deliver_items_merges_consecutive_plain_chunks_into_one_tokens_call() -> None:
    # Ids in order (single ids and lists alike), texts concatenated exactly; what the bridge's coalescing would make of
    # the deltas.
    assert deliver([1, "a", [2, 3], "", 4, "c"]) == [("tokens", [1, 2, 3, 4], "ac")]
    assert deliver([[1, 2], "", [3], ""]) == [("tokens", [1, 2, 3], "")]  # no text at all: the empty string
    assert deliver([1, "\xe4", 2, "", 3, "\ufffd"]) == [("tokens", [1, 2, 3], "\xe4\ufffd")]
    assert deliver([[1, 2], "x"]) == [("tokens", [1, 2], "x")]  # a single chunk as it is


def test_deliver_items_never_merges_across_a_built_chunk() -> None:
    built = LLMEngineOutput(token_ids=[5], text="b", log_probs=[-1.0])
    final = LLMEngineOutput(token_ids=[9], finish_reason="stop")
    got = deliver([1, "a", 2, "b", built, None, 3, "", [4, 5], "c", final, None])
    assert got == [("tokens", [1, 2], "ab"), ("chunk", built), ("tokens", [3, 4, 5], "c"), ("chunk", final)]


def test_merged_tokens_equal_the_deltas_coalesced_by_the_bridge() -> None:
    from collections import deque

    from trio_sidecar.dynamo.coalesce import take_merged

    items = [1, "a", [2, 3], "", 4, "c", [5], ""]
    [(_, ids, text)] = deliver(list(items))
    one_by_one = [
        token_chunk([i] if type(i) is int else i, t).to_dict() for i, t in zip(items[::2], items[1::2], strict=True)
    ]
    assert token_chunk(ids, text).to_dict() == take_merged(deque(one_by_one))


def test_empty_open_batch_is_not_handed_over() -> None:
    builder = BatchBuilder(state(), decode=False)
    assert builder.take_items() is None
    builder.add(prompt().SerializeToString(), False)
    assert builder.take_items() is None
    builder.add(out([7]).SerializeToString(), False)
    items = builder.take_items()
    assert items is not None and len(ChunkBatch(items)) == 1 and builder.take_items() is None


def test_token_chunk_equals_the_attrs_init_for_every_field() -> None:
    for token_ids, text in (([1], "x"), ([2, 3], ""), ([], "")):
        fast = token_chunk(token_ids, text)
        slow = LLMEngineOutput(token_ids=token_ids, text=text)
        assert fast == slow
        for field in attrs.fields(LLMEngineOutput):  # a field added to the class must be set there too
            assert getattr(fast, field.name) == getattr(slow, field.name)
        assert fast.token_ids is token_ids


def test_token_chunk_dict_equals_the_token_chunks_dict() -> None:
    for token_ids, text in (([1], "x"), ([2, 3], ""), ([], "")):
        assert token_chunk_dict(token_ids, text) == token_chunk(list(token_ids), text).to_dict()


def test_deliver_items_without_merging_hands_over_one_tokens_call_per_message() -> None:
    got: list = []
    items = [1, "a", [2, 3], "", 4, "c"]
    deliver_items(items, lambda ids, text: got.append((ids, text)), lambda c: got.append(c), merge=False)
    assert got == [([1], "a"), ([2, 3], ""), ([4], "c")]
