"""Structured concurrency with the typed API against the real mock (docs/embedded.md#recipes,
docs/embedded.md#what-a-blocks-exit-guarantees).

- ``complete_many``: at most ``limit`` requests at a time, results in completion order; a failure cancels
  the rest (stopped in vLLM) unless ``return_exceptions``; leaving early cancels the rest.
- a per-request deadline (``trio.move_on_after`` around ``complete``);
- first-of-N: the first completion wins, the others are stopped in vLLM.
- the exit guarantee: however a request block is left (end, deadline, exception in the loop, a sibling's
  failure), ``engine.in_flight`` is back to zero when the block has returned; the mock then sees every
  stream ended, none finished by itself. The wait is bounded: a request task that cannot end is left
  running after ``EXIT_WAIT``.

The mock models its pass times (``speedup_ratio`` below 1 makes them long) and the tests run on the
``autojump_clock``, so the deadlines are exact and nothing waits in real time.
"""

from __future__ import annotations

import pytest
import trio
from sidecar_fakes import FAST_ENGINE_ARGS, sidecar_config

from trio_sidecar import Completion, InvalidArgument, SamplingParams, open_sidecar
from trio_sidecar.mock import MockConfig, open_mock_server
from trio_sidecar.shell.completion_stream import open_many
from trio_sidecar.shell.engine import EXIT_WAIT
from trio_sidecar.shell.request_task import RequestTask

#: ~0.1 s of modelled time per decode pass.
SLOW = {**FAST_ENGINE_ARGS, "speedup_ratio": 0.05, "max_model_len": 256}


def mock_config() -> MockConfig:
    return MockConfig(listen="127.0.0.1:0", model="mocker-model", engine_args=SLOW)


def tokens(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)


STOPPED = {"drop", "abort"}  # the mock saw the reset stream, or the Control.Abort that follows it, first


async def settled(mock, sidecar) -> dict[str, str | None]:
    """Wait until the mock has no request in flight; return how each of its calls ended (``"finish"``, or
    one of :data:`STOPPED`)."""
    with trio.fail_after(30):
        while mock.active_request_count():
            await trio.sleep(0.01)
    ids = [request.request_id for _rpc, request, _m, _p in mock.recorded_requests]
    return {rid: mock.call_record(rid).ended for rid in ids if mock.call_record(rid) is not None}


async def test_complete_many_returns_results_in_completion_order(autojump_clock):
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            async with sidecar.complete_many(prompts, [tokens(9), tokens(2), tokens(5)], limit=3) as results:
                got = [(index, completion) async for index, completion in results]
            assert sidecar.engine.in_flight == 0
        ended = await settled(mock, sidecar)
    assert [index for index, _ in got] == [1, 2, 0]
    assert [len(c.token_ids) for _, c in got] == [2, 5, 9]
    assert all(isinstance(c, Completion) and c.finish_reason == "length" for _, c in got)
    assert set(ended.values()) == {"finish"}


async def test_complete_many_keeps_at_most_limit_requests_running(autojump_clock):
    running = peak = 0

    async def complete(index, prompt):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await trio.sleep(1 + index % 3)
        running -= 1
        return index

    async with open_many(complete, list(range(10)), limit=3, return_exceptions=False) as results:
        got = [index async for index, _ in results]
    assert sorted(got) == list(range(10)) and peak == 3


async def test_a_failure_in_complete_many_cancels_and_stops_the_rest(autojump_clock):
    too_long = list(range(1, 300))  # beyond max_model_len: vLLM refuses it
    # limit 2: [1, 2] finishes first, then the refused prompt starts while [3, 4] is still generating.
    prompts, params = [[1, 2], [3, 4], too_long], [tokens(5), tokens(100), tokens(5)]
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            got = []
            with pytest.raises(InvalidArgument, match="maximum context length is 256 tokens"):
                async with sidecar.complete_many(prompts, params, limit=2) as results:
                    async for pair in results:
                        got.append(pair)
            assert sidecar.engine.in_flight == 0
        await settled(mock, sidecar)
        by_prompt = {
            tuple(request.token_ids.ids): mock.call_record(request.request_id)
            for _rpc, request, _m, _p in mock.recorded_requests
        }
    assert [(index, len(c.token_ids)) for index, c in got] == [(0, 5)]
    assert by_prompt[(1, 2)].ended == "finish"
    assert by_prompt[(3, 4)].ended in STOPPED and 0 < by_prompt[(3, 4)].tokens_sent < 100
    assert by_prompt[tuple(too_long)] is None  # refused before it was admitted


async def test_complete_many_with_return_exceptions_reports_the_failure_and_goes_on(autojump_clock):
    too_long = list(range(1, 300))
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            async with sidecar.complete_many(
                [[1, 2], too_long, [3, 4]], tokens(4), limit=2, return_exceptions=True
            ) as results:
                got = dict([pair async for pair in results])
            assert sidecar.engine.in_flight == 0
        await settled(mock, sidecar)
    assert isinstance(got[1], InvalidArgument) and "maximum context length" in str(got[1])
    assert [len(got[i].token_ids) for i in (0, 2)] == [4, 4]


async def test_leaving_complete_many_early_stops_the_rest(autojump_clock):
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            async with sidecar.complete_many([[1], [2], [3], [4]], [tokens(2), *[tokens(200)] * 3]) as results:
                index, _completion = await results.receive()  # then leave with three still running
            assert sidecar.engine.in_flight == 0
        ended = await settled(mock, sidecar)
    assert index == 0
    assert sorted(ended.values())[-1] == "finish" and set(sorted(ended.values())[:3]) <= STOPPED


async def test_an_exception_in_the_complete_many_loop_propagates_as_itself_and_stops_the_rest(autojump_clock):
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            with pytest.raises(KeyError, match="consumer failed"):
                async with sidecar.complete_many([[1], [2], [3]], [tokens(2), tokens(200), tokens(200)]) as results:
                    async for _pair in results:
                        raise KeyError("consumer failed")
            assert sidecar.engine.in_flight == 0
        ended = await settled(mock, sidecar)
    assert sorted(ended.values())[-1] == "finish" and set(sorted(ended.values())[:2]) <= STOPPED


async def test_a_deadline_around_complete_stops_the_request_in_vllm(autojump_clock):
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            started = trio.current_time()
            with trio.move_on_after(2.0) as scope:
                await sidecar.complete([1, 2, 3], tokens(200), request_id="late")
            assert scope.cancelled_caught
            assert sidecar.engine.in_flight == 0
            assert trio.current_time() - started == pytest.approx(2.0, abs=0.5)
            ended = await settled(mock, sidecar)
            with trio.fail_after(10):
                while sidecar.engine.aborts_sent < 1:
                    await trio.sleep(0.01)
    assert ended["late"] in STOPPED
    assert 0 < mock.call_record("late").tokens_sent < 200
    assert ["late"] in mock.abort_calls


async def first_of(sidecar, prompts, params) -> Completion:
    """The first completion of several (docs/embedded.md#first-of-n-the-others-stopped): the others are cancelled, which stops
    them in vLLM."""
    winner: Completion | None = None
    async with trio.open_nursery() as nursery:

        async def race(prompt, params):
            nonlocal winner
            completion = await sidecar.complete(prompt, params)
            if winner is None:
                winner = completion
                nursery.cancel_scope.cancel()

        for prompt, p in zip(prompts, params, strict=True):
            nursery.start_soon(race, prompt, p)
    assert winner is not None
    return winner


async def test_first_of_n_returns_the_first_and_stops_the_losers(autojump_clock):
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            winner = await first_of(sidecar, [[1], [2], [3]], [tokens(150), tokens(3), tokens(150)])
            assert sidecar.engine.in_flight == 0
        ended = await settled(mock, sidecar)
    assert len(winner.token_ids) == 3
    assert sorted(ended.values())[-1] == "finish" and set(sorted(ended.values())[:2]) <= STOPPED


@pytest.mark.parametrize("how", ["deadline", "exception", "break"])
async def test_a_stream_blocks_exit_leaves_no_request_in_flight(how, autojump_clock):
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            with trio.move_on_after(1.5):
                try:
                    async with sidecar.stream([1, 2, 3], tokens(200)) as stream:
                        async for delta in stream:
                            assert delta.token_ids
                            if how == "exception":
                                raise KeyError("consumer failed")
                            if how == "break":
                                break
                except KeyError:
                    pass
                else:
                    assert how != "exception"
            assert sidecar.engine.in_flight == 0
        ended = await settled(mock, sidecar)
    assert len(ended) == 1 and set(ended.values()) <= STOPPED


async def test_the_dynamo_shaped_generate_block_has_the_same_exit_guarantee(autojump_clock):
    body = {"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 200, "ignore_eos": True}}
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            with trio.move_on_after(1.0):
                async with sidecar.generate(body) as chunks:
                    async for _chunk in chunks:
                        pass
            assert sidecar.engine.in_flight == 0
        ended = await settled(mock, sidecar)
    assert len(ended) == 1 and set(ended.values()) <= STOPPED


async def test_the_exit_wait_is_bounded_when_a_request_task_cannot_end(autojump_clock, monkeypatch):
    original = RequestTask.run

    async def wedged(self, *args, **kwargs):  # a request task that cannot end (as on a wedged connection)
        await original(self, *args, **kwargs)
        with trio.CancelScope(shield=True):
            await trio.sleep(30)

    monkeypatch.setattr(RequestTask, "run", wedged)
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            started = trio.current_time()
            with trio.move_on_after(1.0):
                async with sidecar.stream([1, 2, 3], tokens(200)) as stream:
                    async for _delta in stream:
                        pass
            assert trio.current_time() - started == pytest.approx(1.0 + EXIT_WAIT, abs=0.1)
            assert sidecar.engine.in_flight == 1  # what remains, as documented; it ends later
            await sidecar.engine.wait_idle()
            assert trio.current_time() - started == pytest.approx(31.0, abs=0.5)
        await settled(mock, sidecar)
