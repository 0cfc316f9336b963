#!/usr/bin/env python3
"""Where trio-sidecar's CPU goes, by layer: a sampling profile of ``trio-sidecar run`` under streaming load.

Usage: python bench/layers.py [--seconds S] [--concurrency C] [--max-tokens T] [--speedup-ratio R] [--pin]
                              [--raw PATH]

Starts the mock (paced by its timing model, ``--speedup-ratio``, default 1), one ``dynamo.frontend`` and
``trio-sidecar run`` on 127.0.0.1, warms up, then records the sidecar with ``py-spy`` (on-CPU samples only,
per thread, 200 Hz) while ``bench/e2e.py``'s streaming client keeps C completions of T tokens in flight. Each
sample is given to the layer of its innermost frame that belongs to one (the table in ``LAYERS``), samples
that only wait in epoll are left out, and the shares are printed per thread: the Trio thread (``MainThread``), the asyncio thread that runs Dynamo's
handler (and the egress threads), and any other Python thread. Dynamo's Rust (tokio) threads run no Python
and do not appear; ``bench/e2e.py`` prints their CPU.

Needs ``py-spy`` (``pip install py-spy``; it reads the sidecar's memory with ptrace, so run as root or
with ``kernel.yama.ptrace_scope`` 0). ``--raw PATH`` keeps py-spy's collapsed stacks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import e2e  # noqa: E402

from trio_sidecar._devtools import local  # noqa: E402
from trio_sidecar.mock.tiny_model import make_tiny_model  # noqa: E402

#: (layer, substrings of a frame "function (file:line)"): the first layer one of whose substrings a frame
#: contains is the frame's layer; a sample counts for the innermost frame that has a layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # py-spy takes a thread blocked in epoll_wait for on-CPU at times; such samples are waits, not work
    (IDLE := "waiting in epoll", ("EpollIOManager.get_events (", "Runner.run (asyncio/runners.py")),
    ("cross-thread hop", ("Waker.", "RequestBridge._wake_loop", "RequestBridge._poke", "dynamo/thread.py")),
    ("sink and merge", ("dynamo/coalesce.py", "_Sink.", "MergingSink", "deliver_items", "token_chunk_dict")),
    ("Dynamo send (asyncio side)", ("RequestBridge._push", "RequestBridge._pull", "_Stream.", "dynamo/egress.py")),
    ("protobuf", ("google/protobuf", "_pb2")),
    ("conversion", ("trio_sidecar/core/convert/", "trio_sidecar/core/protocol.py", "trio_sidecar/core/jsonstruct.py")),
    ("HTTP/2 and gRPC (transport)", ("trio_sidecar/transport/", "/h2/", "/hpack/", "/hyperframe/")),
    (
        "engine and request task",
        (
            "trio_sidecar/shell/request_task.py",
            "trio_sidecar/shell/engine.py",
            "trio_sidecar/shell/pool.py",
            "trio_sidecar/shell/abort.py",
            "trio_sidecar/core/stats.py",
            "trio_sidecar/shell/context.py",
            "trio_sidecar/shell/stream.py",
        ),
    ),
    ("bridge (other)", ("dynamo/bridge.py",)),
    ("Trio scheduler and I/O", ("trio/_",)),
    ("asyncio loop", ("asyncio/", "uvloop")),
    ("Dynamo runtime (Python)", ("site-packages/dynamo/",)),
)
OTHER = "other"


def layer_of(frames: list[str]) -> str:
    """The layer of a sample: that of its innermost frame with one (``frames``: outermost first)."""
    for frame in reversed(frames):
        for layer, needles in LAYERS:
            if any(needle in frame for needle in needles):
                return layer
    return OTHER


def classify(raw: str) -> dict[str, Counter[str]]:
    """py-spy ``--format raw --threads`` lines (``thread (TID): NAME;frame;...;frame COUNT``) → samples per
    layer, per thread name."""
    by_thread: dict[str, Counter[str]] = defaultdict(Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        name = thread.partition(": ")[2] or thread
        by_thread[name][layer_of(frames)] += int(count)
    return by_thread


def _thread_group(name: str) -> str:
    if name == "MainThread":
        return "Trio thread"
    if "asyncio" in name or "egress" in name or "dynamo" in name.lower():
        return "asyncio thread and egress"
    return "other Python threads"


def report(by_thread: dict[str, Counter[str]]) -> str:
    groups: dict[str, Counter[str]] = defaultdict(Counter)
    for name, counts in by_thread.items():
        groups[_thread_group(name)].update(counts)
    for counts in groups.values():
        counts.pop(IDLE, None)
    total = sum(sum(c.values()) for c in groups.values()) or 1
    names = [layer for layer, _ in LAYERS if layer != IDLE] + [OTHER]
    order = [g for g in ("Trio thread", "asyncio thread and egress", "other Python threads") if g in groups]
    lines = ["| layer | " + " | ".join(order) + " | all Python samples |", "|---" + "|---:" * (len(order) + 1) + "|"]
    for layer in names:
        row = [groups[g][layer] / total * 100 for g in order]
        if sum(row) < 0.05:
            continue
        lines.append(f"| {layer} | " + " | ".join(f"{v:.1f}%" for v in row) + f" | {sum(row):.1f}% |")
    lines.append(
        "| all | "
        + " | ".join(f"{sum(groups[g].values()) / total * 100:.1f}%" for g in order)
        + f" | 100% ({total} samples) |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds recorded (default 30)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--speedup-ratio", type=float, default=1.0)
    parser.add_argument("--pin", action="store_true", help="the sidecar on the last CPU, the rest on the others")
    parser.add_argument("--raw", type=Path, help="keep py-spy's collapsed stacks here")
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("error: py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 1
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin:
        os.sched_setaffinity(0, set(cpus[:-1]))
    with tempfile.TemporaryDirectory(prefix="trio-sidecar-layers-") as tmp:
        work = Path(tmp)
        env = local.dynamo_env(work / "kv", DYN_LOG="warn")
        model = make_tiny_model(work / "tiny-model")
        procs: list[local.Process] = []
        try:
            mock, address = local.start_mock(
                work,
                env,
                model=str(model),
                served_model_name=e2e.MODEL,
                engine_args={"speedup_ratio": args.speedup_ratio, "max_num_seqs": 256},
            )
            procs.append(mock)
            frontend, port = local.start_frontend(work, env, namespace="layers")
            procs.append(frontend)
            sidecar = local.start_trio_sidecar(
                work, env, address, namespace="layers", extra=("--log-level", "warning"), name="trio-sidecar"
            )
            procs.append(sidecar)
            if args.pin:
                os.sched_setaffinity(sidecar.pid, {cpus[-1]})
            local.wait_for_models(frontend_port := port, [e2e.MODEL], timeout=120, watch=[sidecar])
            asyncio.run(e2e._load(frontend_port, args.concurrency * 4, args.concurrency, args.max_tokens))  # warm-up
            raw_path = args.raw or work / "stacks.txt"
            record = subprocess.Popen(
                [spy, "record", "--pid", str(sidecar.pid), "--rate", "200", "--format", "raw", "--threads"]
                + ["--nonblocking", "--duration", str(int(args.seconds)), "-o", str(raw_path)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline and record.poll() is None:
                asyncio.run(e2e._load(frontend_port, args.concurrency * 4, args.concurrency, args.max_tokens))
            _, err = record.communicate(timeout=120)
            if record.returncode != 0 or not raw_path.exists():
                print(f"error: py-spy failed: {err.decode(errors='replace')[-1000:]}", file=sys.stderr)
                return 1
            print(
                f"trio-sidecar run, streaming {args.max_tokens}-token completions at concurrency {args.concurrency}, "
                f"mock speedup_ratio {args.speedup_ratio:g}{', sidecar pinned' if args.pin else ''}; "
                f"on-CPU Python samples by layer (innermost frame with a layer; epoll waits left out):\n"
            )
            print(report(classify(raw_path.read_text())))
        finally:
            for proc in reversed(procs):
                proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
