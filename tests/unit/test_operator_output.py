"""What an operator reads: causes as one clause, progress labels, hints, log line format, ``--help`` text,
and the exit code of a signal before serving (in-process; the subprocess versions are in
tests/dynamo/test_worker_operator.py)."""

from __future__ import annotations

import logging
import re
import signal

import pytest
import trio

from trio_sidecar._logging import UtcFormatter, utc_timestamp
from trio_sidecar.cli import OPTIONS, _build_run_parser, main
from trio_sidecar.shell.diagnostics import describe_exception, round_duration, short_cause, startup_hint
from trio_sidecar.shell.progress import StartupProgress, note_failure, tracking


async def test_a_refused_trio_connect_reads_as_one_clause_without_repetition():
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(OSError) as info:
            await trio.open_tcp_stream("127.0.0.1", port)
    text = describe_exception(info.value)
    assert text == f"all attempts to connect to 127.0.0.1:{port} failed: connection refused"
    assert "sub-exception" not in text


def test_a_dns_failure_and_nested_groups_are_named_once():
    import socket

    dns = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert describe_exception(dns) == "DNS lookup failed: Name or service not known"
    group = ExceptionGroup(
        "outer", [ExceptionGroup("inner", [ConnectionRefusedError(111, "x")]), ConnectionRefusedError(111, "y")]
    )
    try:
        raise OSError("connect failed") from group
    except OSError as exc:
        assert describe_exception(exc) == "connect failed: connection refused"


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("all attempts to connect to 127.0.0.1:1 failed: connection refused", "connection refused"),
        ("vllm.Control reported NOT_SERVING", "NOT_SERVING"),
        ("vllm.Control is unavailable through the standard gRPC health API: x (Unimplemented)", "UNIMPLEMENTED"),
        ("DNS lookup failed: Name or service not known", "DNS failure"),
        ("the connection attempt exceeded the startup deadline", "timed out"),
        ("something else entirely", "something else entirely"),
    ],
)
def test_short_cause_labels(text, label):
    assert short_cause(text) == label


def test_startup_failures_get_a_hint_and_unknown_ones_none():
    assert "--grpc-port" not in (startup_hint("x: connection refused") or "")
    assert "fix --grpc-endpoint" in startup_hint("x: connection refused")
    assert "does not resolve" in startup_hint("DNS lookup failed: x")
    assert "--grpc-startup-deadline-secs" in startup_hint(
        "vllm.Control did not become SERVING ...: reported NOT_SERVING"
    )
    assert startup_hint("Custom template file does not exist: /x") is None


def test_durations_in_messages_are_rounded():
    assert round_duration(5.001209002) == 5.0
    assert round_duration(12.46) == 12.5
    assert round_duration(0.0123456) == 0.012


async def test_progress_collects_failures_from_child_tasks_only_while_tracked():
    async def fail_in_a_child(cause: str) -> None:
        note_failure(cause)

    progress = StartupProgress()
    note_failure("ignored: nothing is tracking")
    with tracking(progress):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail_in_a_child, "a: connection refused")
        note_failure("vllm.Control reported NOT_SERVING")
    note_failure("ignored again")
    assert (progress.attempts, progress.last_cause) == (2, "NOT_SERVING")


def test_log_lines_are_utc_iso8601_with_z_like_dynamos(monkeypatch):
    monkeypatch.setenv("TZ", "America/New_York")
    import time

    time.tzset()
    try:
        record = logging.LogRecord("trio_sidecar.x", logging.WARNING, __file__, 1, "hello %s", ("there",), None)
        record.created = 1_796_155_200.25  # 2026-12-01T20:00:00.25Z
        assert UtcFormatter().format(record) == "2026-12-01T20:00:00.250000Z  WARN trio_sidecar.x: hello there"
        assert utc_timestamp(0) == "1970-01-01T00:00:00.000000Z"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_run_help_shows_defaults_choices_no_forms_env_and_exit_codes(capsys):
    assert main(["run", "--help"], environ={}) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--health-prober, --no-health-prober" in text
    assert "--abort-on-cancel, --no-abort-on-cancel" in text
    assert "[default: 8; env: DYN_SIDECAR_GRPC_CONNECTIONS]" in text
    assert "[default: etcd; choices: kubernetes, etcd, file, mem; env: DYN_DISCOVERY_BACKEND]" in text
    assert "[default: true; choices: true, false; env: DYN_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE]" in text
    assert "[default: on; env: TRIO_SIDECAR_HEALTH_PROBER]" in text
    assert "publish this worker's engine control/update routes on the RL request-plane endpoint" in text
    for code in (
        "0 clean shutdown after serving",
        "1 failure after startup began",
        "2 usage or configuration",
        "130 interrupted by SIGINT before serving",
        "143 interrupted by SIGTERM before serving",
    ):
        assert code in text
    for opt in OPTIONS:
        assert opt.flag in text


def test_the_no_forms_set_false_and_the_plain_forms_true():
    parser = _build_run_parser()
    assert parser.parse_args(["--no-health-prober"]).health_prober is False
    assert parser.parse_args(["--health-prober"]).health_prober is True
    assert parser.parse_args(["--no-health-prober", "--health-prober"]).health_prober is True


def test_both_commands_report_usage_errors_as_one_error_line(capsys):
    assert main(["run", "--bogus"], environ={}) == 2
    run_err = capsys.readouterr().err
    assert main(["mock", "--bogus"]) == 2
    mock_err = capsys.readouterr().err
    assert run_err == "error: unrecognized arguments: --bogus (see `trio-sidecar run --help`)\n"
    assert mock_err == "error: unrecognized arguments: --bogus (see `trio-sidecar mock --help`)\n"


def test_a_bad_rl_admin_url_is_one_line_with_the_native_text(capsys):
    argv = ["run", "--grpc-endpoint", "127.0.0.1:1", "--enable-rl", "--vllm-http-endpoint", "http://x?a=1"]
    assert main(argv, environ={}) == 2
    assert capsys.readouterr().err == "error: `--vllm-http-endpoint` must not include a query or fragment\n"


def test_a_signal_before_the_trio_run_is_one_line_and_128_plus_the_signal(capsys, monkeypatch):
    import trio_sidecar.cli as cli

    def interrupted_parse(argv, environ=None):
        signal.raise_signal(signal.SIGTERM)  # arrives while arguments are parsed
        raise AssertionError("the signal must interrupt parsing")  # pragma: no cover

    monkeypatch.setattr(cli, "parse_run_args", interrupted_parse)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["run", "--grpc-endpoint", "127.0.0.1:1"], environ={}) == 143
    err = capsys.readouterr().err
    assert err == "interrupted by SIGTERM before serving; exiting with code 143\n"
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored for an embedding process


def test_mock_tiny_model_option_is_documented(capsys):
    assert main(["mock", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"--tiny-model DIR create \(or reuse\) a tiny local model directory", text), text
