"""What the LoRA tests need to start a LoRA engine that can load adapters (docs/conformance.md#lora-on-the-cpu-build).

- ``make_tiny_lora``: the adapter builder of ``scripts/make_tiny_lora.py`` (standard library only), loaded from
  the checkout so the tests and the command line write the same bytes.
- ``FIELD_ORDER_FIX``: the ``PYTHONPATH`` directory whose ``sitecustomize`` gives vLLM's ``LoRARequest`` back
  the field its Rust frontend still sends; without it every ``LoadLora`` fails inside the engine's
  ``add_lora``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIELD_ORDER_FIX = HERE / "lora_field_order"
BUILDER = HERE.parents[1] / "scripts" / "make_tiny_lora.py"
ALLOWED_PREFIXES = "VLLM_RUNTIME_LORA_ALLOWED_PATH_PREFIXES"


def _load_builder():
    spec = importlib.util.spec_from_file_location("make_tiny_lora", BUILDER)
    assert spec is not None and spec.loader is not None, BUILDER
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_lora = _load_builder()
make_tiny_lora = tiny_lora.make_tiny_lora
