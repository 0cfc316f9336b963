"""``collapse_single_exception``: a lone failure leaves a nursery as itself, with its own cause and context."""

from __future__ import annotations

import pytest
import trio

from trio_sidecar.transport import collapse_single_exception


class Boom(Exception):
    pass


async def _fail_with_context_and_cause() -> None:
    try:
        raise KeyError("the context")
    except KeyError:
        raise Boom("the failure") from ValueError("the cause")


async def _fail_with_context_only() -> None:
    try:
        raise KeyError("the context")
    except KeyError:
        raise Boom("the failure")  # noqa: B904 (the implicit context is what is checked)


async def test_a_lone_failure_keeps_its_cause_and_its_context() -> None:
    with pytest.raises(Boom) as caught:
        with collapse_single_exception():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_fail_with_context_and_cause)
    err = caught.value
    assert isinstance(err.__cause__, ValueError) and str(err.__cause__) == "the cause"
    assert isinstance(err.__context__, KeyError) and err.__suppress_context__


async def test_an_implicit_context_is_kept_and_shown() -> None:
    with pytest.raises(Boom) as caught:
        with collapse_single_exception():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_fail_with_context_only)
    err = caught.value
    assert err.__cause__ is None
    assert isinstance(err.__context__, KeyError) and not err.__suppress_context__


async def test_nested_groups_of_one_are_unwrapped() -> None:
    with pytest.raises(Boom):
        with collapse_single_exception():
            async with trio.open_nursery() as outer:

                async def inner() -> None:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_fail_with_context_only)

                outer.start_soon(inner)


async def test_several_failures_stay_a_group() -> None:
    async def fail(text: str) -> None:
        raise Boom(text)

    with pytest.raises(BaseExceptionGroup) as caught:
        with collapse_single_exception():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fail, "a")
                nursery.start_soon(fail, "b")
    assert sorted(str(e) for e in caught.value.exceptions) == ["a", "b"]
