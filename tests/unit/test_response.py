"""Response conversion (docs/reference/sidecar.md#response-conversion, docs/reference/sidecar.md#per-message-checks): every check, logprobs, terminal, handoff."""

from __future__ import annotations

import math
from typing import Any

import pytest

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.config import DisaggregationMode
from trio_sidecar.core.convert import ResponseState, build_generate_request
from trio_sidecar.core.convert.response import plain_token_fields
from trio_sidecar.core.errors import ErrorKind, ProtocolError
from trio_sidecar.core.jsonstruct import json_to_struct
from trio_sidecar.core.protocol import LLMEngineOutput, cancelled_chunk, structure_request

AGG, PREFILL, DECODE = DisaggregationMode.AGG, DisaggregationMode.PREFILL, DisaggregationMode.DECODE
STOP, LENGTH, ABORTED, NOT_FINISHED = 2, 1, 3, 0


def state(req: dict[str, Any] | None = None, mode: DisaggregationMode = AGG) -> ResponseState:
    request = structure_request(req or {"token_ids": [1, 2, 3]})
    built = build_generate_request(request, "r", "served-model", mode)
    return ResponseState(request, built, mode)


def cand(*tokens: tuple[int, float, int]) -> pb.CandidateTokenInfo:
    return pb.CandidateTokenInfo(
        tokens=[pb.CandidateTokenInfo.TokenInfo(id=i, logprob=lp, rank=r) for i, lp, r in tokens]
    )


def prompt_info(n: int = 3, **kw: Any) -> pb.GenerateResponse:
    return pb.GenerateResponse(prompt_info=pb.PromptInfo(num_prompt_tokens=n, **kw))


def out(
    tokens: list[int],
    *,
    text: str = "",
    num: int | None = None,
    logprobs: list[float] | None = None,
    ranks: list[int] | None = None,
    cands: list[pb.CandidateTokenInfo] | None = None,
    finish: pb.FinishInfo | None = None,
    index: int = 0,
    info: pb.PromptInfo | None = None,
) -> pb.GenerateResponse:
    seq = pb.SequenceOutput(
        index=index,
        text=text,
        num_tokens=len(tokens) if num is None else num,
        token_ids=tokens,
        logprobs=logprobs or [],
        ranks=ranks or [],
        candidate_tokens=cands or [],
    )
    if finish is not None:
        seq.finish_info.CopyFrom(finish)
    resp = pb.GenerateResponse(outputs=seq)
    if info is not None:
        resp.prompt_info.CopyFrom(info)
    return resp


def fin(n: int, reason: int = STOP, **kw: Any) -> pb.FinishInfo:
    return pb.FinishInfo(num_output_tokens=n, finish_reason=reason, **kw)


def fails(st: ResponseState, resp: pb.GenerateResponse, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        st.convert(resp)
    assert str(info.value) == "invalid vLLM gRPC response: " + message
    assert info.value.kind is ErrorKind.UNKNOWN


# ------------------------------------------------------------------- reference example (docs/reference/sidecar.md#reference-example)


def test_reference_aggregated_example() -> None:
    st = state({"token_ids": [1, 2, 3], "output_options": {"logprobs": 1, "prompt_logprobs": 1}})
    info = pb.PromptInfo(
        num_prompt_tokens=3,
        token_ids=[1, 2, 3],
        logprobs=[0.0, -1.0, -2.0],
        ranks=[1, 2, 3],
        candidate_tokens=[cand(), cand((9, -0.5, 1)), cand((3, -2.0, 3))],
    )
    assert st.convert(pb.GenerateResponse(prompt_info=info)) is None
    chunk = st.convert(
        out(
            [42],
            text=" token",
            logprobs=[-0.25],
            ranks=[1],
            cands=[cand((43, -0.5, 2))],
            finish=fin(1, STOP, stop_token_id=2),
        )
    )
    assert chunk is not None and st.finished
    d = chunk.to_dict()
    assert d["token_ids"] == [42] and d["text"] == " token" and d["index"] == 0
    assert d["finish_reason"] == "stop" and d["stop_reason"] == 2
    assert d["log_probs"] == [-0.25]
    assert d["top_logprobs"] == [
        [
            {"rank": 1, "token_id": 42, "token": None, "logprob": -0.25},
            {"rank": 2, "token_id": 43, "token": None, "logprob": -0.5},
        ]
    ]
    assert d["completion_usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    assert d["engine_data"] == {
        "prompt_logprobs": [
            None,
            {"2": {"logprob": -1.0, "rank": 2}, "9": {"logprob": -0.5, "rank": 1}},
            {"3": {"logprob": -2.0, "rank": 3}},
        ]
    }
    assert list(d["engine_data"]["prompt_logprobs"][1]) == ["2", "9"]  # prompt token first
    assert "disaggregated_params" not in d


def test_engine_data_only_on_the_terminal() -> None:
    st = state({"token_ids": [5, 6], "output_options": {"prompt_logprobs": 0}})
    info = pb.PromptInfo(
        num_prompt_tokens=2, token_ids=[5, 6], logprobs=[0.0, -1.5], ranks=[0, 4], candidate_tokens=[cand(), cand()]
    )
    first = st.convert(out([7], info=info))
    assert first is not None and first.engine_data is None and "engine_data" not in first.to_dict()
    last = st.convert(out([8], finish=fin(2, LENGTH)))
    assert last is not None and last.engine_data == {"prompt_logprobs": [None, {"6": {"logprob": -1.5, "rank": 4}}]}


# ------------------------------------------------------------------- top logprobs (docs/reference/sidecar.md#per-message-checks)


@pytest.mark.parametrize(
    ("sampled", "candidates", "expected_ids"),
    [
        (42, [(43, -0.5, 2)], [42, 43]),  # sampled absent: inserted first
        (42, [(42, -0.25, 1), (43, -0.5, 2)], [42, 43]),  # sampled first among candidates: never twice
        (43, [(42, -0.25, 1), (43, -0.5, 2)], [42, 43]),  # server order kept
        (44, [(42, -0.25, 1), (43, -0.5, 2)], [44, 42, 43]),
        (44, [], [44]),
    ],
)
def test_top_logprobs_shape(sampled: int, candidates: list, expected_ids: list[int]) -> None:
    st = state({"token_ids": [1, 2, 3], "output_options": {"logprobs": 2}})
    chunk = st.convert(out([sampled], logprobs=[-0.75], ranks=[3], cands=[cand(*candidates)]))
    assert chunk is not None and chunk.top_logprobs is not None
    [position] = chunk.top_logprobs
    assert [e.token_id for e in position] == expected_ids
    by_id = {e.token_id: e for e in position}
    if sampled not in {c[0] for c in candidates}:
        assert (by_id[sampled].rank, by_id[sampled].logprob) == (3, -0.75)


def test_logprobs_zero_gives_log_probs_without_top() -> None:
    st = state({"token_ids": [1, 2, 3], "output_options": {"logprobs": 0}})
    chunk = st.convert(out([42], logprobs=[-0.25], ranks=[1], cands=[cand((43, -0.5, 2))]))
    assert chunk is not None
    d = chunk.to_dict()
    assert d["log_probs"] == [-0.25] and "top_logprobs" not in d


def test_no_logprobs_requested_ignores_arrays() -> None:
    st = state()
    chunk = st.convert(out([42, 43], logprobs=[-0.25]))  # arrays not checked when not requested
    assert chunk is not None and chunk.log_probs is None and chunk.top_logprobs is None


@pytest.mark.parametrize("bad", [-math.inf, math.inf, math.nan, -1e9])
def test_logprob_floor(bad: float) -> None:
    st = state({"token_ids": [1, 2], "output_options": {"logprobs": 1, "prompt_logprobs": 1}})
    info = pb.PromptInfo(
        num_prompt_tokens=2,
        token_ids=[1, 2],
        logprobs=[0.0, bad],
        ranks=[0, 1],
        candidate_tokens=[cand(), cand((8, bad, 2))],
    )
    st.convert(pb.GenerateResponse(prompt_info=info))
    chunk = st.convert(out([42], logprobs=[bad], ranks=[1], cands=[cand((43, bad, 2))], finish=fin(1)))
    assert chunk is not None
    assert chunk.log_probs == [-9999.0]
    assert [e.logprob for e in chunk.top_logprobs[0]] == [-9999.0, -9999.0]  # type: ignore[index]
    assert chunk.engine_data == {
        "prompt_logprobs": [None, {"2": {"logprob": -9999.0, "rank": 1}, "8": {"logprob": -9999.0, "rank": 2}}]
    }


def test_logprob_floor_keeps_finite_values_above() -> None:
    st = state({"token_ids": [1], "output_options": {"logprobs": 0}})
    chunk = st.convert(out([1], logprobs=[-9998.5], ranks=[1], cands=[cand()]))
    assert chunk is not None and chunk.log_probs == [-9998.5]


# ------------------------------------------------------------------- consistency checks (docs/reference/sidecar.md#per-message-checks)


def test_prompt_count_mismatch() -> None:
    fails(state(), prompt_info(4), "prompt token count 4 does not match request count 3")


def test_prompt_logprob_lengths() -> None:
    st = state({"token_ids": [1, 2, 3], "output_options": {"prompt_logprobs": 1}})
    fails(
        st,
        prompt_info(3, token_ids=[1, 2, 3], logprobs=[0.0, 1.0], ranks=[1, 2, 3], candidate_tokens=[cand()] * 3),
        "prompt logprob array lengths do not match expected count 3: token_ids=3, logprobs=2, ranks=3, candidate_tokens=3",
    )


def test_prompt_logprob_lengths_not_checked_when_not_requested() -> None:
    assert state().convert(prompt_info(3, token_ids=[1])) is None


def test_unsupported_index() -> None:
    fails(state(), out([1], index=1), "received unsupported sequence index 1")


def test_num_tokens_mismatch() -> None:
    fails(state(), out([1, 2], num=3), "num_tokens 3 does not match 2 token IDs")


def test_output_logprob_lengths() -> None:
    st = state({"token_ids": [1, 2, 3], "output_options": {"logprobs": 1}})
    fails(
        st,
        out([1, 2], logprobs=[-1.0, -2.0], ranks=[1], cands=[cand(), cand()]),
        "output logprob array lengths do not match expected count 2: token_ids=2, logprobs=2, ranks=1, candidate_tokens=2",
    )


def test_terminal_count_mismatch() -> None:
    st = state()
    st.convert(out([1, 2]))
    fails(st, out([3], finish=fin(2)), "terminal num_output_tokens 2 does not match streamed count 3")


def test_not_finished_and_unknown_reasons() -> None:
    fails(state(), out([1], finish=fin(1, NOT_FINISHED)), "terminal response has NOT_FINISHED finish reason")
    fails(state(), out([1], finish=fin(1, 9)), "unknown finish reason 9")


def test_eof_message_is_a_protocol_error() -> None:
    err = ProtocolError("GenerateStream ended before a terminal response")
    assert str(err) == "invalid vLLM gRPC response: GenerateStream ended before a terminal response"


# ------------------------------------------------------------------- finish / stop reasons (docs/reference/sidecar.md#per-message-checks item 5)


@pytest.mark.parametrize(
    ("finish", "reason", "stop_reason"),
    [
        (fin(1, LENGTH), "length", None),
        (fin(1, STOP, stop_token_id=2), "stop", 2),
        (fin(1, STOP, eos_token_id=0), "stop", 0),
        (fin(1, STOP, stop_string="done"), "stop", "done"),
        (fin(1, STOP), "stop", None),
        (fin(1, ABORTED), "cancelled", None),
    ],
)
def test_finish_and_stop_reasons(finish: pb.FinishInfo, reason: str, stop_reason: Any) -> None:
    chunk = state().convert(out([5], finish=finish))
    assert chunk is not None
    d = chunk.to_dict()
    assert d["finish_reason"] == reason
    assert d.get("stop_reason") == stop_reason
    assert ("stop_reason" in d) is (stop_reason is not None)


def test_streaming_usage_and_silent_messages() -> None:
    st = state({"token_ids": [1, 2, 3, 4, 5]})
    assert st.convert(prompt_info(5)) is None
    assert st.convert(pb.GenerateResponse()) is None  # no outputs
    assert st.convert(out([])) is None  # no tokens, no finish
    c1 = st.convert(out([10], text="a"))
    c2 = st.convert(out([11, 12], text=""))
    assert c1 is not None and c2 is not None
    assert c1.to_dict() == {"token_ids": [10], "index": 0, "text": "a"}
    assert c2.to_dict() == {"token_ids": [11, 12], "index": 0, "text": ""}  # held back: "" (never absent)
    assert st.completion_tokens == 3
    term = st.convert(out([], finish=fin(3, LENGTH)))
    assert term is not None
    assert term.to_dict() == {
        "token_ids": [],
        "index": 0,
        "text": "",
        "finish_reason": "length",
        "completion_usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


def test_every_chunk_but_prefills_carries_text_and_prefill_chunks_carry_none() -> None:
    # Dynamo's frontend detokenizes a chunk without ``text`` itself (a partial UTF-8 token then comes out as
    # U+FFFD): every non-prefill chunk carries vLLM's text, "" when vLLM held it back.
    st = state()
    held = st.convert(out([7], text=""))
    done = st.convert(out([8], text="\u00e4", finish=fin(2, LENGTH)))
    assert held is not None and done is not None
    assert [held.to_dict()["text"], done.to_dict()["text"]] == ["", "\u00e4"]
    assert state().cancelled_chunk().to_dict()["text"] == ""
    prefill = state(mode=PREFILL)
    assert "text" not in prefill.cancelled_chunk().to_dict()


def test_data_after_terminal_is_ignored() -> None:
    st = state()
    assert st.convert(out([1], finish=fin(1))) is not None
    assert st.convert(out([2, 3])) is None
    assert st.convert(out([9], index=7, finish=fin(5, 0))) is None  # not even checked
    assert st.completion_tokens == 1


def test_terminal_disaggregated_params() -> None:
    st = state()
    finish = fin(1, STOP)
    finish.kv_transfer_params.CopyFrom(json_to_struct({"remote_port": 20097, "ids": [7, 8]}))
    chunk = st.convert(out([1], finish=finish))
    assert chunk is not None and chunk.disaggregated_params == {"remote_port": 20097, "ids": [7, 8]}


# ------------------------------------------------------------------- prefill


def prefill_finish(**extra: Any) -> pb.FinishInfo:
    finish = fin(1, LENGTH)
    finish.kv_transfer_params.CopyFrom(
        json_to_struct({"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_port": 20097, **extra})
    )
    return finish


def test_prefill_terminal_handoff() -> None:
    st = state(mode=PREFILL)
    assert st.convert(prompt_info(3)) is None
    assert st.convert(out([42], text="x")) is None  # prefill non-terminal: nothing
    chunk = st.convert(out([], finish=prefill_finish()))
    assert chunk is not None
    assert chunk.to_dict() == {
        "token_ids": [],
        "index": 0,
        "finish_reason": "length",
        "completion_usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3},
        "disaggregated_params": {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_port": 20097},
    }


def test_prefill_terminal_with_token_and_text_has_no_tokens() -> None:
    st = state({"token_ids": [1, 2, 3], "output_options": {"logprobs": 1}}, mode=PREFILL)
    chunk = st.convert(out([42], text=" t", finish=prefill_finish()))
    assert chunk is not None and chunk.token_ids == [] and chunk.text is None and chunk.log_probs is None
    assert st.cancelled_chunk().completion_usage.completion_tokens == 0  # type: ignore[union-attr]


def test_prefill_terminal_without_kv_params() -> None:
    fails(state(mode=PREFILL), out([1], finish=fin(1, LENGTH)), "prefill terminal is missing kv_transfer_params")


def test_non_finite_kv_params_from_server() -> None:
    finish = fin(1)
    finish.kv_transfer_params.fields["x"].number_value = math.nan
    fails(state(), out([1], finish=finish), "kv_transfer_params contains NaN or infinity")


# ------------------------------------------------------------------- cancelled chunks and transfer


def test_cancelled_chunk_counts_streamed_tokens() -> None:
    st = state()
    assert st.cancelled_chunk().to_dict() == {
        "token_ids": [],
        "index": 0,
        "text": "",
        "finish_reason": "cancelled",
        "completion_usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3},
    }
    st.convert(out([1, 2]))
    assert st.cancelled_chunk().completion_usage.to_dict() == {  # type: ignore[union-attr]
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
    }
    assert cancelled_chunk(4, 1).to_dict()["completion_usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 1,
        "total_tokens": 5,
    }


@pytest.mark.parametrize(
    ("resp", "completes"),
    [
        (pb.GenerateResponse(), False),
        (prompt_info(3), False),
        (out([]), False),
        (out([1]), True),
        (out([], finish=fin(0, ABORTED)), True),
    ],
)
def test_completes_transfer(resp: pb.GenerateResponse, completes: bool) -> None:
    assert ResponseState.completes_transfer(resp) is completes


def test_output_dict_round_trip() -> None:
    st = state({"token_ids": [1, 2, 3], "output_options": {"logprobs": 1}})
    chunk = st.convert(
        out(
            [42],
            text="x",
            logprobs=[-0.25],
            ranks=[1],
            cands=[cand((43, -0.5, 2))],
            finish=fin(1, STOP, stop_string="s"),
        )
    )
    assert chunk is not None
    assert LLMEngineOutput.from_dict(chunk.to_dict()).to_dict() == chunk.to_dict()


def test_repr_shows_live_state() -> None:
    st = state()
    st.convert(out([1]))
    assert "completion_tokens=1" in repr(st) and "finished=False" in repr(st)


# ------------------------------------------------------------------- the plain fast path


@pytest.mark.parametrize(
    ("req", "mode", "resp", "plain"),
    [
        (None, AGG, out([5], text="a"), (5, "a")),
        (None, AGG, out([5]), (5, "")),
        (None, AGG, out([5, 300, 70000], text="é"), ([5, 300, 70000], "é")),
        (None, DECODE, out([5], text="a"), (5, "a")),
        (None, AGG, out([]), None),  # no tokens: no chunk
        (None, AGG, pb.GenerateResponse(), None),  # no outputs
        (None, AGG, prompt_info(3), None),
        (None, AGG, out([5], info=pb.PromptInfo(num_prompt_tokens=3)), None),  # prompt info is checked
        (None, AGG, out([5], index=1), None),  # -> received unsupported sequence index 1
        (None, AGG, out([5, 6], num=1), None),  # -> num_tokens 1 does not match 2 token IDs
        (None, AGG, out([5], num=2), None),
        (None, AGG, out([5, 6], num=3), None),
        (None, AGG, out([5], finish=fin(1)), None),  # terminal
        (
            {"token_ids": [1, 2, 3], "output_options": {"logprobs": 0}},
            AGG,
            out([5], logprobs=[-1.0], ranks=[1], cands=[cand()]),
            None,
        ),
        (None, PREFILL, out([5], text="a"), None),
    ],
)
def test_convert_plain_is_convert_for_plain_messages_only(req, mode, resp, plain) -> None:
    if mode is DECODE:
        req = {"token_ids": [1, 2, 3], "prefill_result": {"disaggregated_params": {"x": 1}}}
    fast, slow = state(req, mode), state(req, mode)
    assert fast.convert_plain(resp.SerializeToString()) == plain
    if plain is None:
        assert fast.completion_tokens == 0  # nothing counted: convert() takes the message
        return
    chunk = slow.convert(resp)
    assert chunk is not None
    ids, text = plain
    assert chunk == LLMEngineOutput(token_ids=[ids] if isinstance(ids, int) else ids, text=text)
    assert fast.completion_tokens == slow.completion_tokens


def test_convert_plain_ignores_data_after_the_terminal() -> None:
    st = state()
    st.convert(out([1], finish=fin(1)))
    assert st.convert_plain(out([2]).SerializeToString()) is None and st.completion_tokens == 1


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encoded(ids: bytes, count: int, text: bytes = b"") -> bytes:
    """GenerateResponse{outputs{text, num_tokens=count, token_ids=<ids: the packed bytes as given>}}."""
    inner = (
        (b"\x12" + varint(len(text)) + text if text else b"")
        + b"\x18"
        + varint(count)
        + b"\x22"
        + varint(len(ids))
        + ids
    )
    return b"\x12" + varint(len(inner)) + inner


@pytest.mark.parametrize(
    ("data", "fields"),
    [
        (encoded(b"\x05", 1, b"a"), (5, "a")),
        (encoded(varint(300), 1), (300, "")),
        (encoded(varint(70000), 1, "é".encode()), (70000, "é")),
        (encoded(varint(2**32 - 1), 1), (2**32 - 1, "")),  # five bytes
        (encoded(b"\x01" + varint(300) + varint(2**30), 3), ([1, 300, 2**30], "")),
        (encoded(b"\x05", 1, b"t" * 200), (5, "t" * 200)),  # two-byte lengths
        (b"\x12\x85\x00" + encoded(b"\x05", 1)[2:], (5, "")),  # an overlong length: protobuf reads it too
        (encoded(b"\x01\x02", 1), None),  # two ids, one counted
        (encoded(varint(300) + b"\x02", 1), None),
        (encoded(b"\x01" + varint(300), 1), None),
        (encoded(b"\x85", 1), None),  # a truncated id
        (encoded(b"\x01\x82", 2), None),
        (encoded(b"\x01\x02\x82", 2), None),  # a truncated third id after the two counted
        (encoded(b"\x01", 2), None),  # num_tokens 2, one id: convert() raises
        (encoded(b"", 0), None),  # no tokens
        (encoded(b"\x80\x80\x80\x80\x10", 1), None),  # 2**32: not a uint32
        (encoded(b"\x81\x80\x80\x80\x80\x00", 1), None),  # six bytes
        (encoded(b"\x05", 1, b"\xff"), None),  # not UTF-8: protobuf's error
        (encoded(b"\x05", 1, b"\xed\xa0\x80"), None),  # a UTF-8-encoded surrogate
        (encoded(b"\x05", 1)[:-1], None),  # truncated message
        (encoded(b"\x05", 1) + b"\x00", None),  # trailing bytes
        (b"\x0a\x00" + encoded(b"\x05", 1), None),  # prompt_info first
        (b"\x12\x07\x08\x00" + encoded(b"\x05", 1)[2:], None),  # an explicit index 0
        (b"\x12\x04\x18\x01\x20\x05", None),  # an unpacked id (protobuf reads it)
        (b"", None),
    ],
)
def test_plain_token_fields_reads_only_canonical_tokens_and_text(data: bytes, fields: Any) -> None:
    assert plain_token_fields(data) == fields
    if fields is not None:  # what protobuf reads from the same bytes
        seq = pb.GenerateResponse.FromString(data).outputs
        ids = list(seq.token_ids)
        assert fields == ((ids[0] if len(ids) == 1 else ids), seq.text)
