"""Deterministic generation (docs/reference/mock.md#deterministic-generation, docs/reference/mock.md#termination): the reference values of docs/reference/mock.md#reference-values are pinned here, and the framed-token table gives protobuf's bytes."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.mock.fast import framed_token_encoder
from trio_sidecar.mock.generation import (
    TOKEN_BASE,
    TOKEN_SPAN,
    CandidateSpec,
    OutputOptions,
    TokenPlan,
    build_prompt_info,
    build_sequence_output,
    candidates_for,
    plan_output,
    planned_tokens,
    prompt_token_seed,
    request_uuid,
    token_at,
    token_logprob,
    token_seed,
)
from trio_sidecar.transport import FramedMessages

FinishReason = pb.FinishInfo.FinishReason

REFERENCE = [
    ("stable", "df0aafa1-cb31-44d6-a837-9077669d9491", 15457534571703110367, [31728, 29888, 3667, 8592, 6614]),
    ("req-1", "94018e85-20cf-4bff-a6e9-40286bc3a062", 18445564437412577684, [2110, 19376, 28263, 4772, 16215]),
]


@pytest.mark.parametrize(("request_id", "expected_uuid", "expected_seed", "expected_tokens"), REFERENCE)
def test_reference_values_of_section_7_3(request_id, expected_uuid, expected_seed, expected_tokens):
    assert request_uuid(42, request_id) == expected_uuid
    assert token_seed(42, request_id) == expected_seed
    assert planned_tokens(42, request_id, 5) == expected_tokens
    assert [token_at(expected_seed, p) for p in range(5)] == expected_tokens


def test_preparation_is_deterministic_and_seed_dependent():
    assert planned_tokens(42, "x", 8) == planned_tokens(42, "x", 8)
    assert request_uuid(42, "x") == request_uuid(42, "x")
    assert planned_tokens(43, "x", 8) != planned_tokens(42, "x", 8)
    assert request_uuid(43, "x") != request_uuid(42, "x")


@settings(deadline=None)  # a loaded 2-core CI machine can stall one example past the default 200 ms
@given(st.integers(0, 2**64 - 1), st.text(max_size=40))
def test_uuid_is_version_4_rfc_variant_and_tokens_in_range(seed, request_id):
    u = uuid.UUID(request_uuid(seed, request_id))
    assert u.version == 4
    assert u.variant == uuid.RFC_4122
    for t in planned_tokens(seed, request_id, 4):
        assert 1000 <= t < 32000


def test_prompt_seed_source_depends_only_on_the_prompt():
    a = prompt_token_seed(42, [1, 2, 3])
    assert a == prompt_token_seed(42, (1, 2, 3))
    assert a != prompt_token_seed(42, [1, 2, 4])
    assert a != prompt_token_seed(7, [1, 2, 3])


def test_logprob_examples():
    assert token_logprob(31728) == pytest.approx(-0.9)
    assert token_logprob(3667) == pytest.approx(-0.8)
    assert token_logprob(8592) == pytest.approx(-0.3)


def test_plan_length_and_stop_token():
    seed = token_seed(42, "stable")
    plan = plan_output(seed, 5)
    assert plan.tokens == (31728, 29888, 3667, 8592, 6614)
    assert plan.finish_reason == FinishReason.LENGTH and plan.stop_token_id is None

    stopped = plan_output(seed, 5, 0, [3667])
    assert stopped.tokens == (31728, 29888, 3667)
    assert stopped.finish_reason == FinishReason.STOP and stopped.stop_token_id == 3667

    masked = plan_output(seed, 5, 3, [3667])  # the match at p=2 < min_new_tokens is ignored
    assert masked.tokens == plan.tokens and masked.finish_reason == FinishReason.LENGTH


def test_candidates_top_n_lists_the_sampled_token_first():
    cands = candidates_for(31728, -0.9, CandidateSpec("top_n", top_n=3))
    assert [(c[0], c[2]) for c in cands] == [(31728, 1), (31729, 2), (31730, 3)]
    assert [c[1] for c in cands] == pytest.approx([-0.9, -1.0, -1.1])
    assert len(candidates_for(5000, -0.1, CandidateSpec("top_n", top_n=50))) == 20


def test_candidates_all_and_token_ids():
    all_ = candidates_for(100, -0.1, CandidateSpec("all"))
    assert [c[0] for c in all_] == list(range(101, 121))
    assert all_[0][2] == 2 and all_[0][1] == pytest.approx(-0.2)
    ids = candidates_for(100, -0.1, CandidateSpec("token_ids", token_ids=(7, 8)))
    assert [(c[0], c[2]) for c in ids] == [(7, 2), (8, 3)]
    assert candidates_for(100, -0.1, None) == []


def test_candidate_spec_from_proto():
    assert CandidateSpec.from_proto(pb.CandidateTokens(top_n=2)) == CandidateSpec("top_n", top_n=2)
    assert CandidateSpec.from_proto(pb.CandidateTokens(all=False)) is None
    assert CandidateSpec.from_proto(pb.CandidateTokens()) is None
    spec = CandidateSpec.from_proto(pb.CandidateTokens(token_ids=pb.TokenIds(ids=list(range(30)))))
    assert spec.token_ids == tuple(range(20))


def test_sequence_output_shapes():
    plain = build_sequence_output([31728, 29888], OutputOptions())
    assert plain.text == "<token:31728><token:29888>" and plain.num_tokens == 2
    assert list(plain.token_ids) == [] and len(plain.candidate_tokens) == 0

    opts = OutputOptions.from_proto(pb.ResponseOptions(output_text=False, output_token_ids=True, output_logprobs=True))
    out = build_sequence_output([31728], opts)
    assert out.text == "" and list(out.token_ids) == [31728]
    assert list(out.logprobs) == pytest.approx([-0.9]) and list(out.ranks) == [1]
    assert len(out.candidate_tokens) == 1 and len(out.candidate_tokens[0].tokens) == 0

    with_cands = OutputOptions.from_proto(pb.ResponseOptions(output_candidates=pb.CandidateTokens(top_n=2)))
    out = build_sequence_output([31728], with_cands)
    assert list(out.logprobs) == []  # candidates alone do not add logprobs
    assert [t.id for t in out.candidate_tokens[0].tokens] == [31728, 31729]


@pytest.mark.parametrize("text", [True, False])
@pytest.mark.parametrize("token_ids", [True, False])
@pytest.mark.parametrize("extra", ["none", "logprobs", "candidates"])
def test_framed_token_table_gives_the_protobuf_bytes(text, token_ids, extra):
    options = OutputOptions(
        text=text,
        token_ids=token_ids,
        logprobs=extra == "logprobs",
        candidates=CandidateSpec("top_n", top_n=3) if extra == "candidates" else None,
        candidates_requested=extra == "candidates",
    )
    framed = framed_token_encoder(options)
    edges = [
        0,
        1,
        127,
        128,
        TOKEN_BASE - 1,
        TOKEN_BASE,
        TOKEN_BASE + TOKEN_SPAN - 1,
        TOKEN_BASE + TOKEN_SPAN,
        2**32 - 21,
    ]
    tokens = edges + list(range(TOKEN_BASE, TOKEN_BASE + TOKEN_SPAN, 7 if extra == "none" else 997))
    for _ in range(2):  # built, then from the table
        for token in tokens:
            message = pb.GenerateResponse(outputs=build_sequence_output([token], options))
            assert framed(token) == FramedMessages.frame(message.SerializeToString()), token


def test_prompt_info():
    info = build_prompt_info((11, 22, 33), pb.ResponseOptions())
    assert info.num_prompt_tokens == 3 and list(info.token_ids) == []
    info = build_prompt_info((11, 22, 33), pb.ResponseOptions(prompt_token_ids=True))
    assert list(info.token_ids) == [11, 22, 33] and list(info.logprobs) == []
    info = build_prompt_info(
        (11, 22, 33), pb.ResponseOptions(prompt_logprobs=True, prompt_candidates=pb.CandidateTokens(top_n=2))
    )
    assert list(info.token_ids) == [11, 22, 33]
    assert list(info.logprobs) == pytest.approx([0.0, -0.3, -0.4])
    assert list(info.ranks) == [0, 1, 1]
    assert len(info.candidate_tokens) == 3
    assert len(info.candidate_tokens[0].tokens) == 0
    assert [t.id for t in info.candidate_tokens[1].tokens] == [22, 23]


def test_pure_modules_do_not_import_trio():
    code = (
        "import sys\n"
        "import trio_sidecar.mock.validation, trio_sidecar.mock.generation\n"
        "import trio_sidecar.mock.handoff, trio_sidecar.mock.multimodal\n"
        "assert 'trio' not in sys.modules, 'trio imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_token_plan_behaves_like_a_tuple():
    seed = token_seed(42, "stable")
    plan = TokenPlan(seed, 5)
    expected = (31728, 29888, 3667, 8592, 6614)
    assert len(plan) == 5 and tuple(plan) == expected and list(plan) == list(expected)
    assert plan[0] == 31728 and plan[-1] == 6614 and plan[1:3] == expected[1:3] and plan[3:] == expected[3:]
    assert plan[::2] == expected[::2] and plan[10:] == ()
    with pytest.raises(IndexError):
        plan[5]
    with pytest.raises(IndexError):
        plan[-6]
    assert plan == expected and plan == TokenPlan(seed, 5) and plan != TokenPlan(seed, 4) and plan != expected[:4]
    assert bool(plan) and not TokenPlan(seed, 0)
    assert 3667 in plan and plan.index(8592) == 3
    assert repr(plan) == "TokenPlan([31728, 29888, 3667, 8592, 6614], len=5)"


def test_large_plans_hold_no_tokens_and_out_of_range_stops_never_match():
    plan = plan_output(token_seed(42, "big"), 32768, 0, [2, 0, 999, 32000])  # EOS-like ids: no match possible
    assert len(plan.tokens) == 32768 and plan.finish_reason == FinishReason.LENGTH
    assert plan.tokens[32767] == planned_tokens(42, "big", 32768)[-1]
