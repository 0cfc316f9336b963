"""``scripts/make_tiny_lora.py``: the PEFT adapter the real-vLLM LoRA tests load (docs/conformance.md#lora-on-the-cpu-build).

The real server is the judge of whether vLLM accepts the adapter (``tests/real_vllm/test_real_lora.py``);
here: the same arguments write the same bytes, and the file is the safetensors layout with PEFT's names and
shapes for the tiny Llama, read back with an independent parser.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_lora.py"
MODULES = {
    "self_attn.q_proj": (128, 128),
    "self_attn.k_proj": (128, 128),
    "self_attn.v_proj": (128, 128),
    "self_attn.o_proj": (128, 128),
    "mlp.gate_proj": (128, 256),
    "mlp.up_proj": (128, 256),
    "mlp.down_proj": (256, 128),
}


def _builder():
    spec = importlib.util.spec_from_file_location("make_tiny_lora", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_safetensors(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert (8 + length) % 8 == 0, "the tensor data must start 8-byte aligned"
    header = json.loads(data[8 : 8 + length])
    body = data[8 + length :]
    out, end = {}, 0
    for name, entry in header.items():
        start, stop = entry["data_offsets"]
        assert entry["dtype"] == "F32" and start == end, (name, entry)
        count = entry["shape"][0] * entry["shape"][1]
        assert stop - start == 4 * count, (name, entry)
        out[name] = (entry["shape"], list(struct.unpack(f"<{count}f", body[start:stop])))
        end = stop
    assert end == len(body), "trailing bytes after the last tensor"
    return out


def digest(directory: Path) -> str:
    return hashlib.sha256(
        b"".join((directory / n).read_bytes() for n in sorted(p.name for p in directory.iterdir()))
    ).hexdigest()


def test_the_adapter_has_peft_names_and_shapes_for_the_tiny_llama(tmp_path):
    path = _builder().make_tiny_lora(tmp_path / "a", rank=4, seed=7)
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["target_modules"] == sorted(m.rsplit(".", 1)[1] for m in MODULES)
    tensors = read_safetensors(path / "adapter_model.safetensors")
    expected = {}
    for layer in range(2):
        for module, (fan_in, fan_out) in MODULES.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            expected[f"{prefix}.lora_A.weight"] = [4, fan_in]
            expected[f"{prefix}.lora_B.weight"] = [fan_out, 4]
    assert {name: shape for name, (shape, _) in tensors.items()} == expected
    values = [v for _, vs in tensors.values() for v in vs]
    assert all(-0.5 <= v < 0.5 for v in values)
    assert 0.27 < (sum(v * v for v in values) / len(values)) ** 0.5 < 0.31  # uniform: 1/sqrt(12) = 0.289
    assert len({tuple(vs[:4]) for _, vs in tensors.values()}) == len(tensors)  # every tensor has its own values


def test_the_same_arguments_write_the_same_bytes_and_a_seed_changes_them(tmp_path):
    make = _builder().make_tiny_lora
    first, again = make(tmp_path / "1", seed=1), make(tmp_path / "2", seed=1)
    other = make(tmp_path / "3", seed=2)
    assert digest(first) == digest(again) != digest(other)
    assert (first / "adapter_config.json").read_bytes() == (other / "adapter_config.json").read_bytes()


def test_the_command_refuses_a_non_empty_directory_unless_forced(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep").write_text("x")

    def run(*args):
        return subprocess.run(
            [sys.executable, str(SCRIPT), str(target), *args], capture_output=True, text=True, timeout=60
        )

    refused = run()
    assert refused.returncode == 2 and "exists and is not empty (use --force to replace it)" in refused.stderr
    assert (target / "keep").exists()
    done = run("--force", "--rank", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(target)
    assert sorted(p.name for p in target.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((target / "adapter_config.json").read_text())["r"] == 2
    with pytest.raises(ValueError, match="rank must be at least 1, got 0"):
        _builder().make_tiny_lora(tmp_path / "zero", rank=0)
