"""``trio-sidecar mock`` speaks vLLM's and ``dynamo.mocker``'s command-line language: ``--host``/``--grpc-port``
(``--listen`` stays), first-class engine flags that win over ``--extra-engine-args``, and ``--version``."""

from __future__ import annotations

import argparse

import pytest

import trio_sidecar
from trio_sidecar.mock import cli
from trio_sidecar.mock.engine_args import PreemptionMode


def _ns(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "listen"),
    [
        ((), "127.0.0.1:50051"),
        (("--grpc-port", "0"), "127.0.0.1:0"),
        (("--host", "0.0.0.0", "--grpc-port", "9000"), "0.0.0.0:9000"),
        (("--host", "::1"), "[::1]:50051"),
        (("--listen", "127.0.0.1:7"), "127.0.0.1:7"),
    ],
)
def test_host_and_grpc_port_make_the_listen_address_and_default_to_loopback(argv, listen):
    assert cli._listen(_ns(*argv)) == listen


@pytest.mark.parametrize("extra", [("--host", "127.0.0.1"), ("--grpc-port", "1")])
def test_listen_with_host_or_grpc_port_is_a_usage_error(extra, capsys):
    assert cli.main(["--listen", "127.0.0.1:0", *extra]) == 2
    assert "--listen cannot be combined with --host or --grpc-port" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["-1", "65536", "x"])
def test_a_bad_grpc_or_metrics_port_is_a_usage_error(port, capsys):
    assert cli.main(["--grpc-port", port]) == 2
    assert cli.main(["--metrics-port", port]) == 2
    assert capsys.readouterr().err.count("invalid port") == 2


def test_engine_flags_set_the_engine_args_and_win_over_the_json():
    ns = _ns(
        "--extra-engine-args",
        '{"block_size": 16, "max_num_seqs": 8, "speedup_ratio": 2.0, "max_model_len": 100}',
        "--block-size",
        "32",
        "--num-gpu-blocks-override",
        "500",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "256",
        "--speedup-ratio",
        "0",
        "--decode-speedup-ratio",
        "3",
        "--data-parallel-size",
        "2",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--preemption-mode",
        "fifo",
    )
    args = cli._engine_args(ns)
    assert (args.block_size, args.num_gpu_blocks, args.max_num_seqs, args.max_num_batched_tokens) == (32, 500, 4, 256)
    assert (args.speedup_ratio, args.decode_speedup_ratio, args.dp_size) == (0.0, 3.0, 2)
    assert (args.enable_prefix_caching, args.enable_chunked_prefill) == (False, True)
    assert args.preemption_mode is PreemptionMode.FIFO
    assert args.max_model_len == 100  # a key no flag names keeps the JSON's value


def test_without_engine_flags_the_json_alone_decides():
    args = cli._engine_args(_ns("--extra-engine-args", '{"block_size": 16, "enable_prefix_caching": false}'))
    assert (args.block_size, args.enable_prefix_caching, args.max_num_seqs) == (16, False, 256)


def test_engine_flag_values_get_the_json_checks(capsys):
    assert cli.main(["--listen", "127.0.0.1:0", "--preemption-mode", "newest"]) == 2
    assert "preemption_mode" in capsys.readouterr().err
    assert cli.main(["--listen", "127.0.0.1:0", "--data-parallel-size", "0"]) == 2
    assert "dp_size" in capsys.readouterr().err


def test_help_lists_dynamo_mocker_flags(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--host", "--grpc-port", "--metrics-port", "--version", *(f[0] for f in cli.ENGINE_FLAGS)):
        assert flag in text, flag
    assert "--no-enable-prefix-caching" in text


def test_version_prints_the_package_report(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"trio-sidecar {trio_sidecar.__version__}") and out[2].startswith("vLLM protocol: ")


def test_tiny_model_makes_words_the_text_unless_the_json_names_a_text_mode():
    from trio_sidecar.mock.engine_args import TextMode

    assert cli._engine_args(_ns("--tiny-model", "x"), words=True).text_mode is TextMode.WORDS
    named = _ns("--tiny-model", "x", "--extra-engine-args", '{"text_mode": "tags"}')
    assert cli._engine_args(named, words=True).text_mode is TextMode.TAGS
    assert cli._engine_args(_ns()).text_mode is TextMode.TAGS
