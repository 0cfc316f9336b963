"""Build the tiny local model directory the Dynamo frontend needs (no weights, no downloads).

Used by ``trio-sidecar mock --tiny-model DIR`` and by ``python scripts/make_tiny_model.py OUTPUT_DIR [--force]``.
Building needs the ``tokenizers`` package (a dependency of Dynamo; in the ``test`` extra too).

The Dynamo frontend reads the model card, tokenizer and chat template from a local directory; it never needs
weights (docs/dynamo.md, "Tiny model"). The directory holds:

- ``tokenizer.json``: a byte-level BPE trained with ``tokenizers`` on a few synthetic sentences (special
  tokens ``<s>`` = 0, ``</s>`` = 1, ``<pad>`` = 2), whose vocabulary is then padded up to
  ``VOCAB_SIZE`` (32,000) entries. The mock server generates ids in [1000, 32000) and the frontend
  detokenizes every id it streams, so every id must exist. The padding entries are pronounceable synthetic
  words with a leading space (``Ġ`` in byte-level form: id 1000 decodes to `` dedopa``); they are plain
  vocabulary entries reachable by no merge, so encoding text never produces them and prompts tokenize
  exactly as with the trained BPE alone.
- ``tokenizer_config.json``: fast tokenizer, bos/eos/pad and a trivial chat template rendering
  ``"{role}: {content}\\n"`` per message and ending with ``assistant: ``.
- ``config.json`` / ``generation_config.json``: a LLaMA stub with ``vocab_size`` equal to the tokenizer's.

An existing complete directory with the same format version is reused (the build is deterministic), so
tests and the demo can call this every time. ``--force`` rebuilds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

__all__ = [
    "VOCAB_SIZE",
    "FORMAT_VERSION",
    "MARKER",
    "FILES",
    "CHAT_TEMPLATE",
    "synthetic_word",
    "build_tokenizer_json",
    "build_files",
    "is_complete",
    "make_tiny_model",
    "main",
]

VOCAB_SIZE = 32_000
FORMAT_VERSION = 1
MARKER = ".trio-sidecar-tiny-model"
FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]  # 70

_CORPUS_WORDS = (
    "hello world the quick brown fox jumps over a lazy dog tiny model serves tokens through a trio sidecar "
    "into the dynamo frontend which streams chat completions back to every client while the mock engine "
    "pretends to be vllm on a small cpu machine with no weights at all"
).split()


def synthetic_word(token_id: int) -> str:
    """A pronounceable three-syllable word, unique for ids below 70**3.

    The id is first permuted (7919 is coprime with 70**3) so neighbouring ids read differently.
    """
    n = len(_SYLLABLES)
    token_id = (token_id * 7919) % (n * n * n)
    return _SYLLABLES[(token_id // (n * n)) % n] + _SYLLABLES[(token_id // n) % n] + _SYLLABLES[token_id % n]


def _corpus() -> list[str]:
    # Deterministic sentences: every rotation of the word list, plus a few fixed chat-like lines.
    words = _CORPUS_WORDS
    lines = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    lines += [
        "user: hello\nassistant: hi there",
        "system: you are a helpful assistant",
        "Hello, World! 0123456789 (tokens) [ok] {json: true}",
    ]
    return lines


def build_tokenizer_json() -> dict:
    """Train the byte-level BPE and pad its vocabulary to VOCAB_SIZE entries (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    data = json.loads(tok.to_str())

    vocab: dict[str, int] = data["model"]["vocab"]
    for index, name in enumerate(SPECIAL_TOKENS):
        if vocab.get(name) != index:
            raise RuntimeError(f"special token {name!r} did not get id {index}")
    used = set(vocab)
    next_id = max(vocab.values()) + 1
    if next_id > 1000:
        raise RuntimeError(f"trained vocabulary too large ({next_id} ids)")
    while next_id < VOCAB_SIZE:
        word = "\u0120" + synthetic_word(next_id)  # "Ġ" is the byte-level form of a space
        suffix = 0
        candidate = word
        while candidate in used:
            suffix += 1
            candidate = f"{word}{suffix}"
        vocab[candidate] = next_id
        used.add(candidate)
        next_id += 1
    return data


def build_files() -> dict[str, str]:
    tokenizer = build_tokenizer_json()
    vocab_size = len(tokenizer["model"]["vocab"])
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, name in enumerate(SPECIAL_TOKENS)
        },
    }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    generation_config = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    dump = lambda obj: json.dumps(obj, indent=2, ensure_ascii=False) + "\n"  # noqa: E731
    return {
        "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False),
        "tokenizer_config.json": dump(tokenizer_config),
        "config.json": dump(config),
        "generation_config.json": dump(generation_config),
    }


def is_complete(directory: Path) -> bool:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == FORMAT_VERSION and all((directory / f).is_file() for f in FILES)


def make_tiny_model(directory: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Create (or reuse) the tiny model directory and return its absolute path.

    The files are written to a temporary sibling directory and renamed into place, so concurrent callers
    (parallel test sessions) never see a half-written model.
    """
    target = Path(directory).resolve()
    if not force and is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    for name, text in build_files().items():
        (staging / name).write_text(text, encoding="utf-8")
    (staging / MARKER).write_text(json.dumps({"format": FORMAT_VERSION, "vocab_size": VOCAB_SIZE}) + "\n")
    if target.exists():
        if not force and is_complete(target):  # another process won the race
            _remove_tree(staging)
            return target
        _remove_tree(target)
    try:
        staging.rename(target)
    except OSError:
        if not is_complete(target):
            raise
        _remove_tree(staging)
    return target


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="model directory to create (reused when already complete)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the directory is complete")
    args = parser.parse_args(argv)
    try:
        path = make_tiny_model(args.output_dir, force=args.force)
    except ImportError:
        print("error: the `tokenizers` package is required (pip install tokenizers)", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
