#!/usr/bin/env python3
"""Build a tiny PEFT LoRA adapter for the real vLLM's tiny Llama (docs/conformance.md#lora-on-the-cpu-build).

Usage: python scripts/make_tiny_lora.py OUTPUT_DIR [--rank R] [--seed S] [--force]

Standard library only (no torch, no peft, no network); the same arguments write the same bytes. The adapter
targets every linear layer of the two decoder layers of ``scripts/make_tiny_llama.py``'s model (hidden 128,
intermediate 256): ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``, with the key names and
shapes PEFT writes (``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`` of shape
``[r, in]``, ``lora_B.weight`` of shape ``[out, r]``), as float32 in ``adapter_model.safetensors`` (an
8-byte little-endian header length, a JSON header, the raw little-endian data).

The weights are a fixed pseudo-random function of the seed, uniform in [-0.5, 0.5] for A and B alike. Their
product is about ten times larger than the base model's weights (initialised with standard deviation 0.02),
so greedy output with the adapter differs from the base model's: that is how a test sees it was applied.
A different seed gives a different adapter.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
from pathlib import Path

HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
# (module path under the layer, in_features, out_features)
MODULES = (
    ("self_attn.q_proj", HIDDEN, HIDDEN),
    ("self_attn.k_proj", HIDDEN, HIDDEN),
    ("self_attn.v_proj", HIDDEN, HIDDEN),
    ("self_attn.o_proj", HIDDEN, HIDDEN),
    ("mlp.gate_proj", HIDDEN, INTERMEDIATE),
    ("mlp.up_proj", HIDDEN, INTERMEDIATE),
    ("mlp.down_proj", INTERMEDIATE, HIDDEN),
)
DEFAULT_RANK = 8
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def adapter_config(rank: int) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(path.rsplit(".", 1)[1] for path, _, _ in MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def _values(count: int, stream: int) -> bytes:
    """``count`` float32 values in [-0.5, 0.5]: a 64-bit LCG (Knuth's MMIX constants), top 24 bits."""
    state = (stream * 0x9E3779B97F4A7C15 + 1) % 2**64
    out = bytearray()
    for _ in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out += struct.pack("<f", (state >> 40) / 2**24 - 0.5)
    return bytes(out)


def tensors(rank: int, seed: int) -> dict[str, tuple[list[int], bytes]]:
    """PEFT key -> (shape, float32 little-endian data), in a fixed order."""
    out: dict[str, tuple[list[int], bytes]] = {}
    stream = seed * 1000
    for layer in range(LAYERS):
        for path, fan_in, fan_out in MODULES:
            prefix = f"base_model.model.model.layers.{layer}.{path}"
            for name, shape in (("lora_A", [rank, fan_in]), ("lora_B", [fan_out, rank])):
                stream += 1
                out[f"{prefix}.{name}.weight"] = (shape, _values(shape[0] * shape[1], stream))
    return out


def safetensors_bytes(named: dict[str, tuple[list[int], bytes]]) -> bytes:
    header: dict[str, dict] = {}
    offset = 0
    for name, (shape, data) in named.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(encoded)) + encoded + b"".join(data for _, data in named.values())


def make_tiny_lora(directory: str | Path, *, rank: int = DEFAULT_RANK, seed: int = 1, force: bool = False) -> Path:
    """Write the adapter into ``directory`` (created; an existing non-empty one needs ``force``)."""
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    path = Path(directory)
    if path.exists() and any(path.iterdir()):
        if not force:
            raise FileExistsError(f"{path} exists and is not empty (use --force to replace it)")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_NAME).write_text(json.dumps(adapter_config(rank), indent=2) + "\n")
    (path / WEIGHTS_NAME).write_bytes(safetensors_bytes(tensors(rank, seed)))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir")
    parser.add_argument("--rank", type=int, default=DEFAULT_RANK, help=f"LoRA rank (default {DEFAULT_RANK})")
    parser.add_argument("--seed", type=int, default=1, help="weights seed (default 1)")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty directory")
    args = parser.parse_args(argv)
    try:
        path = make_tiny_lora(args.output_dir, rank=args.rank, seed=args.seed, force=args.force)
    except (FileExistsError, ValueError) as e:
        print(f"make_tiny_lora.py: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
