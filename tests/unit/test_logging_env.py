"""How Dynamo's logging environment is read: ``DYN_LOGGING_JSONL``/``DYN_LOGGING_CONSOLE_FORMAT`` select JSON
lines, and ``DYN_LOG``'s directives give the sidecar's loggers their levels as Rust's ``EnvFilter`` would."""

from __future__ import annotations

import logging

import pytest

from trio_sidecar._logging import dyn_log_levels, dynamo_json_requested


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"DYN_LOGGING_JSONL": "1"}, True),
        ({"DYN_LOGGING_JSONL": "true"}, True),
        ({"DYN_LOGGING_JSONL": "0"}, False),
        ({"DYN_LOGGING_CONSOLE_FORMAT": "jsonl"}, True),
        ({"DYN_LOGGING_CONSOLE_FORMAT": "readable"}, False),
    ],
)
def test_json_lines_are_selected_by_dynamos_variables(env, expected):
    assert dynamo_json_requested(env) is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", {}),
        ("debug", {"trio_sidecar": logging.DEBUG}),
        ("warn", {"trio_sidecar": logging.WARNING}),
        ("trace", {"trio_sidecar": logging.DEBUG}),
        ("info,trio_sidecar=debug", {"trio_sidecar": logging.DEBUG}),
        ("trio_sidecar=debug,info", {"trio_sidecar": logging.DEBUG}),  # the named target wins in any order
        ("error,trio_sidecar.pool=debug", {"trio_sidecar": logging.ERROR, "trio_sidecar.pool": logging.DEBUG}),
        ("info,dynamo_runtime=debug,trio=debug", {"trio_sidecar": logging.INFO}),  # other targets
        ("bogus", {}),
    ],
)
def test_dyn_log_directives_give_the_sidecars_loggers_their_levels(value, expected):
    assert dyn_log_levels(value) == expected
