"""scripts/make_tiny_model.py: the local model directory the Dynamo frontend reads (docs/reference/worker.md#tiny-model-directory)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dynamo

tokenizers = pytest.importorskip("tokenizers")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_model.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tokenizer_covers_every_mock_token_id_and_detokenizes_it(tmp_path):
    path = _load_script().make_tiny_model(tmp_path / "tiny")
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() >= 32_000
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == tok.get_vocab_size()
    assert config["eos_token_id"] == 1 and config["bos_token_id"] == 0
    # The mock generates ids in [1000, 32000): each must detokenize to non-empty text.
    for token_id in (1000, 1001, 12345, 31999):
        text = tok.decode([token_id])
        assert text.strip(), token_id
    assert tok.decode([1000, 1001]) == tok.decode([1000]) + tok.decode([1001])
    assert tok.token_to_id("<s>") == 0 and tok.token_to_id("</s>") == 1 and tok.token_to_id("<pad>") == 2


def test_prompts_round_trip_and_never_produce_padding_ids(tmp_path):
    path = _load_script().make_tiny_model(tmp_path / "tiny")
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in ("hello world", "user: hello\nassistant: ", "Über naïve 123 {json: true}"):
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
        assert max(ids) < 1000


def test_an_existing_model_is_reused_and_force_rebuilds_identically(tmp_path):
    target = tmp_path / "tiny"
    run = [sys.executable, str(SCRIPT), str(target)]
    first = subprocess.run(run, capture_output=True, text=True, check=True)
    assert Path(first.stdout.strip()) == target.resolve()
    before = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    subprocess.run(run, capture_output=True, text=True, check=True)
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == before
    tokenizer_before = (target / "tokenizer.json").read_bytes()
    subprocess.run([*run, "--force"], capture_output=True, text=True, check=True)
    assert (target / "tokenizer.json").read_bytes() == tokenizer_before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging leftovers


def test_an_incomplete_directory_is_rebuilt(tmp_path):
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "config.json").write_text("{}")
    _load_script().make_tiny_model(target)
    assert json.loads((target / "config.json").read_text())["vocab_size"] >= 32_000


def test_every_mock_token_id_decodes_to_a_space_and_the_mocks_word(tmp_path):
    from trio_sidecar.mock.tiny_model import WORDS, word_text

    path = _load_script().make_tiny_model(tmp_path / "tiny")
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = list(range(1000, 32_000))
    assert [tok.decode([i]) for i in ids[::997]] == [word_text(i) for i in ids[::997]]
    assert tok.decode(ids[:50]) == "".join(word_text(i) for i in ids[:50])
    assert {word_text(i)[1:] for i in ids} == set(WORDS)  # every word is used
    for text in ("the quick river", "κόσμε 🙂 naïve", '<tool_call>{"a": 1}</tool_call>'):
        encoded = tok.encode(text).ids
        assert tok.decode(encoded) == text and max(encoded) < 1000  # any text encodes (byte-level BPE)
