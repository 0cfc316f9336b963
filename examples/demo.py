#!/usr/bin/env python3
"""End-to-end demo: mock vLLM → ``trio-sidecar run`` → Dynamo frontend → a streamed chat completion.

Usage: python examples/demo.py [--prompt TEXT] [--max-tokens N] [--keep-logs]

Everything runs on 127.0.0.1 with free ports and file discovery in a temporary directory:

1. builds the tiny local model directory (tokenizer + chat template, no weights, no downloads);
2. starts the CPU-only mock vLLM gRPC server (``trio-sidecar mock``);
3. shows the model the sidecar discovers through vLLM's Control service (the embeddable Trio API);
4. starts ``trio-sidecar run`` (a real Dynamo 1.6.1 worker) and ``python -m dynamo.frontend``;
5. streams an OpenAI chat completion through the frontend to the terminal;
6. stops every process by its PID (SIGTERM; the model leaves the frontend at once) and exits 0.

Needs the Dynamo packages (``scripts/install-dynamo.sh .venv/bin/python``, run by ``make demo``).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

console = Console(highlight=False)


def _load_tiny_model_builder():
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.make_tiny_model


def _show_discovered_model(endpoint: str) -> None:
    """The bootstrap phase of docs/reference/sidecar.md#bootstrap-phase through the embeddable API (``trio_sidecar.api.discover``)."""
    import trio

    from trio_sidecar import SidecarConfig, discover
    from trio_sidecar.core.model import engine_config

    model = trio.run(discover, SidecarConfig(grpc_endpoint=endpoint, startup_deadline=30.0))
    limits = engine_config(model)
    table = Table(title="Model discovered through vllm.Control", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("model_id", model.model_id),
        ("served name", model.served_model_name),
        ("engine", f"{model.server_info.engine_version} ({model.server_info.instance_id})"),
        ("KV block size", str(limits.kv_cache_block_size)),
        ("total KV blocks", str(limits.total_kv_blocks)),
        ("max seqs", str(limits.max_num_seqs)),
        ("max batched tokens", str(limits.max_num_batched_tokens)),
        ("data-parallel size", str(model.data_parallel_size())),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="trio-sidecar end-to-end demo (mock vLLM + Dynamo frontend)")
    parser.add_argument("--prompt", default="Tell me about structured concurrency.")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--keep-logs", action="store_true", help="keep the temporary directory with all logs")
    args = parser.parse_args(argv)

    try:
        from trio_sidecar._devtools import local
    except ImportError as exc:  # pragma: no cover - the package itself is missing
        console.print(f"[red]error:[/] {exc}")
        return 1
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.frontend") is None:
        console.print(
            "[red]error:[/] Dynamo 1.6.1 is not installed; run "
            "`scripts/install-dynamo.sh .venv/bin/python` (or `make demo`)"
        )
        return 1

    workdir = Path(tempfile.mkdtemp(prefix="trio-sidecar-demo-"))
    env = local.dynamo_env(workdir / "file-kv")
    processes: list = []
    ok = False
    try:
        console.rule("[bold]trio-sidecar demo")
        model_dir = _load_tiny_model_builder()(workdir / "tiny-model")
        console.print(f"tiny model directory: {model_dir}")

        with console.status("starting the mock vLLM gRPC server ..."):
            mock, address = local.start_mock(
                workdir,
                env,
                model=str(model_dir),
                served_model_name="tiny",
                # "words": each token's text is its word in the tiny model's vocabulary
                engine_args={"speedup_ratio": 1.0, "text_mode": "words"},
            )
        processes.append(mock)
        console.print(f"[green]✓[/] mock vLLM (pid {mock.pid}) on {address}")
        _show_discovered_model(address)

        with console.status("starting the Dynamo frontend and trio-sidecar run ..."):
            frontend, http_port = local.start_frontend(workdir, env, namespace="demo")
            processes.append(frontend)
            sidecar = local.start_trio_sidecar(workdir, env, address, namespace="demo")
            processes.append(sidecar)
            waited = local.wait_for_models(http_port, ["tiny"], timeout=180, watch=[frontend, sidecar, mock])
        console.print(
            f"[green]✓[/] trio-sidecar run (pid {sidecar.pid}) registered `tiny`; "
            f"frontend (pid {frontend.pid}) on http://127.0.0.1:{http_port} "
            f"(ready in {waited:.1f}s)"
        )
        console.print(
            f"[dim]$ curl -sN http://127.0.0.1:{http_port}/v1/chat/completions "
            f'-d \'{{"model": "tiny", "stream": true, ...}}\'[/]'
        )

        console.rule("[bold]streamed chat completion")
        console.print(f"[bold]user:[/] {args.prompt}")
        console.print("[bold]assistant:[/]", end="")  # each word brings its leading space
        payload = {
            "model": "tiny",
            "messages": [{"role": "user", "content": args.prompt}],
            "max_tokens": args.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        usage = finish = None
        start = time.monotonic()
        with local.stream_sse(http_port, "/v1/chat/completions", payload) as events:
            for event in events:
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        console.out(text, end="", highlight=False)
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or usage
        console.out("")
        console.print(
            f"[dim]finish_reason={finish} usage={usage} in {time.monotonic() - start:.2f}s "
            "(the mock's deterministic tokens, words of the tiny model's vocabulary)[/]"
        )

        console.rule("[bold]shutdown")
        sidecar.send_signal(signal.SIGTERM)
        gone = local.wait_for_no_model(http_port, "tiny", timeout=10)
        code = sidecar.wait(60)
        console.print(
            f"[green]✓[/] SIGTERM: `tiny` left /v1/models after {gone:.2f}s; trio-sidecar exited {code}"
            if gone is not None
            else f"[red]✗[/] `tiny` still listed after SIGTERM; trio-sidecar exited {code}"
        )
        ok = gone is not None and code == 0 and finish is not None
    except KeyboardInterrupt:
        console.print("\n[yellow]interrupted[/]")
    except Exception as exc:  # noqa: BLE001 - a demo reports and cleans up
        console.print(f"\n[red]error:[/] {exc}")
    finally:
        codes = {}
        for proc in reversed(processes):
            codes[proc.name] = proc.stop()
        console.print("stopped: " + ", ".join(f"{name} → {code}" for name, code in codes.items()))
        ok = ok and all(code == 0 for code in codes.values())
        if args.keep_logs or not ok:
            console.print(f"logs: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
