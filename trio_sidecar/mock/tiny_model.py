"""Build the tiny local model directory the Dynamo frontend needs (no weights, no downloads).

Used by ``trio-sidecar mock --tiny-model DIR`` and by ``python scripts/make_tiny_model.py OUTPUT_DIR [--force]``.
Building needs the ``tokenizers`` package (a dependency of Dynamo; in the ``test`` extra too).

The Dynamo frontend reads the model card, tokenizer and chat template from a local directory; it never needs
weights (docs/dynamo.md, "Tiny model"). The directory holds:

- ``tokenizer.json``: a byte-level BPE trained with ``tokenizers`` on a few synthetic sentences (special
  tokens ``<s>`` = 0, ``</s>`` = 1, ``<pad>`` = 2), whose vocabulary is then padded up to
  ``VOCAB_SIZE`` (32,000) entries. The mock server generates ids in [1000, 32000) and the frontend
  detokenizes every id it streams, so every id must exist. Each padding id is a common English word with a
  leading space (:func:`word_text`: id 1000 decodes to `` dog``), so the mock's output reads as words
  (``text_mode = "words"``, the default of ``trio-sidecar mock --tiny-model``). Vocabulary entries must be
  unique and 31,000 ids share a few hundred words, so each entry is the word's byte-level form followed by
  ``⁑{id}`` (a character outside the byte-level alphabet, which no trained token contains); the decoder
  removes that suffix before the byte-level decoding. The padding entries are reachable by no merge, so
  encoding text never produces them: any text, in any script, still encodes with the trained byte-level
  BPE (every byte has a token) and prompts tokenize exactly as with it alone.
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
    "WORDS",
    "WordText",
    "word_text",
    "VOCAB_SIZE",
    "FORMAT_VERSION",
    "MARKER",
    "FILES",
    "CHAT_TEMPLATE",
    "build_tokenizer_json",
    "build_files",
    "is_complete",
    "make_tiny_model",
    "main",
]

VOCAB_SIZE = 32_000
#: The first padding id (the mock generates ids from here on; docs/reference/mock.md#tokens).
FIRST_WORD_ID = 1000
FORMAT_VERSION = 2
MARKER = ".trio-sidecar-tiny-model"
FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_CORPUS_WORDS = (
    "hello world the quick brown fox jumps over a lazy dog tiny model serves tokens through a trio sidecar "
    "into the dynamo frontend which streams chat completions back to every client while the mock engine "
    "pretends to be vllm on a small cpu machine with no weights at all"
).split()


#: The words of the padding ids: common English words, so that any sequence of them reads as words.
WORDS: tuple[str, ...] = tuple(
    """
    the a of and to in is it that was for on are with as at be this have from or one had by but not what
    all were when we there can an your which their said if do will each about how up out them then she many
    some so these would other into has more her two like him see time could no make than first been its who
    now people my made over did down only way find use may water long little very after words called just
    where most know get through back much go good new write our me man too any day same right look think
    also around another came come work three word must because does part even place well such here take why
    things help put years different away again off went old number great tell men say small every found
    still between name should home big give air line set own under read last never us left end along while
    might next sound below saw something thought both few those always looked show large often together asked
    house world going want school important until form food keep children feet land side without boy once
    animals life enough took sometimes four head above kind began almost live page got earth need far hand
    high year mother light parts country father let night following picture being study second eyes soon
    times story boys since white days ever paper hard near sentence better best across during today others
    however sure means knew trying river mountain quiet bright garden window morning evening stone bridge
    forest ocean city music letter train green blue warm gentle clear simple careful patient steady
    """.split()
)
_WORD_MARK = "\u2051"  # "⁑": outside the byte-level alphabet, so no trained token contains it


def word_text(token_id: int) -> str:
    """The text of a padding id (``>= FIRST_WORD_ID``): a space and a common English word.

    The id is permuted first (7919 is prime, coprime with the word count) so neighbouring ids read
    differently.
    """
    return " " + WORDS[(token_id * 7919) % len(WORDS)]


class WordText:
    """``text_mode = "words"`` in the mock server: each output token's text is :func:`word_text` (ids below
    ``FIRST_WORD_ID``, which the mock never generates, keep their ``<token:{id}>`` tag). The interface of
    ``mock.generation.ByteDetokenizer``: nothing is held back."""

    __slots__ = ()

    def step(self, tokens: list[int] | tuple[int, ...]) -> str:
        return "".join(word_text(t) if t >= FIRST_WORD_ID else f"<token:{t}>" for t in tokens)

    def finish(self) -> str:
        return ""


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
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.Sequence([decoders.Replace(Regex(_WORD_MARK + "[0-9]+"), ""), decoders.ByteLevel()])
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
    next_id = max(vocab.values()) + 1
    if next_id > FIRST_WORD_ID:
        raise RuntimeError(f"trained vocabulary too large ({next_id} ids)")
    for token_id in range(next_id, VOCAB_SIZE):
        # "Ġ" is the byte-level form of a space; the words are ASCII, their own byte-level form.
        vocab["\u0120" + word_text(token_id)[1:] + f"{_WORD_MARK}{token_id}"] = token_id
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
