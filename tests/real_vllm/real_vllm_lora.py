"""What the LoRA tests need to start a LoRA engine that can load adapters (docs/conformance.md#lora-on-the-cpu-build).

- ``make_tiny_lora``: the adapter builder of ``scripts/make_tiny_lora.py`` (standard library only), loaded from
  the checkout so the tests and the command line write the same bytes.
- ``FIELD_ORDER_FIX``: the ``PYTHONPATH`` directory whose ``sitecustomize`` gives vLLM's ``LoRARequest`` back
  the field its Rust frontend still sends; without it every ``LoadLora`` fails inside the engine's
  ``add_lora``.
- ``launch_lora_server``: ``vllm serve --enable-lora --max-loras N`` with that fix, allowing local adapters
  under one directory (not yet waited for: ``wait_ready`` is the caller's).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from real_vllm_server import RealVllmEnv, RealVllmServer

HERE = Path(__file__).resolve().parent
FIELD_ORDER_FIX = HERE / "lora_field_order"
BUILDER = HERE.parents[1] / "scripts" / "make_tiny_lora.py"
ALLOWED_PREFIXES = "VLLM_RUNTIME_LORA_ALLOWED_PATH_PREFIXES"
MAX_LORAS = 2


def _load_builder():
    spec = importlib.util.spec_from_file_location("make_tiny_lora", BUILDER)
    assert spec is not None and spec.loader is not None, BUILDER
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_lora = _load_builder()
make_tiny_lora = tiny_lora.make_tiny_lora


def launch_lora_server(env: RealVllmEnv, adapter_dir: Path, *extra_args: str) -> RealVllmServer:
    """A Python-launched LoRA server whose only allowed prefix for local adapters is ``adapter_dir``."""
    return RealVllmServer(
        env,
        launch="python",
        extra_args=("--enable-lora", "--max-loras", str(MAX_LORAS), *extra_args),
        extra_env={"PYTHONPATH": str(FIELD_ORDER_FIX), ALLOWED_PREFIXES: str(adapter_dir)},
    )
