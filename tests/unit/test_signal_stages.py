"""SIGINT/SIGTERM before the Trio run: a stage-1 signal whose ``Interrupted`` was swallowed (raised inside a
``__del__`` or a weakref callback, where Python only prints "Exception ignored") is replayed in stage 2; one
that reached the entry point is not."""

from __future__ import annotations

import os
import signal

import pytest

from trio_sidecar import _signals


@pytest.fixture
def stage_one():
    previous = _signals.install_interrupt_handlers()
    try:
        yield
    finally:
        _signals.held()
        _signals.restore_handlers(previous)


def test_a_swallowed_stage_one_signal_is_replayed_after_the_hand_over(stage_one):
    try:
        os.kill(os.getpid(), signal.SIGINT)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a call that lets the handler run here
    except _signals.Interrupted:
        pass  # swallowed, as in a __del__ during an import
    _signals.hold_signals()
    assert _signals.held() == [signal.SIGINT]


def test_a_stage_one_signal_that_reached_the_entry_point_is_not_replayed(stage_one):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])
    except _signals.Interrupted:
        _signals.forget_held()  # what the CLI's entry point does with it
    _signals.hold_signals()
    assert _signals.held() == []
