"""Issue 6 test 3: prefill + decode workers with two mocks behind one frontend (disaggregated serving)."""

from __future__ import annotations

import pytest
from dynamo_harness import FAST_ENGINE_ARGS

from trio_sidecar.dynamo import local

pytestmark = pytest.mark.dynamo

SEED = 42


@pytest.fixture(scope="module")
def pd(deployment_factory):
    dep = deployment_factory()
    prefill = dep.mock(served_model_name="tiny", seed=SEED, disaggregation_mode="prefill",
                       engine_args=FAST_ENGINE_ARGS)
    decode = dep.mock(served_model_name="tiny", seed=SEED, disaggregation_mode="decode",
                      engine_args=FAST_ENGINE_ARGS)
    dep.frontend()
    dep.trio_sidecar(prefill, "--disaggregation-mode", "prefill", name="prefill-sidecar")
    dep.trio_sidecar(decode, "--disaggregation-mode", "decode", name="decode-sidecar")
    dep.wait_ready("tiny")
    return dep, prefill, decode


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_is_prefilled_on_one_worker_and_decoded_on_the_other(pd, path):
    from trio_sidecar.mock import planned_tokens

    dep, prefill, decode = pd
    before_p, before_d = len(prefill.recorded()), len(decode.recorded())
    payload = {"model": "tiny", "max_tokens": 5, "ignore_eos": True, "nvext": {"extra_fields": ["worker_id"]}}
    if path == "/v1/completions":
        payload["prompt"] = "hello world " * 8
    else:
        payload["messages"] = [{"role": "user", "content": "hello world " * 8}]
    status, body = local.post_json(dep.http_port, path, payload)
    assert status == 200, body
    workers = body["nvext"]["worker_id"]
    assert workers["prefill_worker_id"] != workers["decode_worker_id"]

    p_reqs = [req for _, req, _, _ in prefill.recorded()[before_p:]]
    d_reqs = [req for _, req, _, _ in decode.recorded()[before_d:]]
    assert len(p_reqs) == 1 and len(d_reqs) == 1
    # The prefill request computes the prompt; the decode request carries the prefill's transfer params.
    assert p_reqs[0].stopping.max_new_tokens == 1
    assert list(p_reqs[0].token_ids.ids) == list(d_reqs[0].token_ids.ids)
    params = d_reqs[0].kv.kv_transfer_params
    assert params.fields, "the decode request carries no kv_transfer_params"
    # The decode mock generated the answer, seeded by the decode request's id.
    expected = "".join(f"<token:{t}>" for t in planned_tokens(SEED, d_reqs[0].request_id, 5))
    choice = body["choices"][0]
    text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    assert text == expected
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
