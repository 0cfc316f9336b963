"""SIGINT/SIGTERM before the Trio run: a stage-1 signal whose ``Interrupted`` was swallowed (raised inside a
``__del__`` or a weakref callback, where Python only prints "Exception ignored") is replayed in stage 2; one
that reached the entry point is not."""

from __future__ import annotations

import os
import signal
import sys

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


class _Owner:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the handler runs inside __del__, which swallows it


def test_a_swallowed_stage_one_signal_prints_no_exception_ignored_traceback(stage_one):
    seen = []
    previous_hook = _signals._previous_unraisablehook
    _signals._previous_unraisablehook = seen.append
    try:
        _Owner()  # dropped at once: __del__ runs, raises Interrupted, and Python hands it to sys.unraisablehook
        assert seen == []
        assert _signals.held() == [signal.SIGINT]
    finally:
        _signals._previous_unraisablehook = previous_hook


def test_other_unraisable_exceptions_still_reach_the_previous_hook(stage_one):
    seen = []
    previous_hook = _signals._previous_unraisablehook
    _signals._previous_unraisablehook = seen.append

    class Broken:
        def __del__(self):
            raise ValueError("kept")

    try:
        Broken()
        assert [str(args.exc_value) for args in seen] == ["kept"]
    finally:
        _signals._previous_unraisablehook = previous_hook


def test_the_entry_point_exits_130_for_a_swallowed_signal_when_no_trio_run_replayed_it(monkeypatch, capsys):
    from trio_sidecar import cli

    def swallowing_main(argv, environ):
        _Owner()
        return 0

    monkeypatch.setattr(cli, "_main", swallowing_main)
    assert cli.main([]) == 130
    assert "interrupted by SIGINT" in capsys.readouterr().err
    assert _signals.held() == []
    assert sys.unraisablehook is not _signals._quiet_unraisable
