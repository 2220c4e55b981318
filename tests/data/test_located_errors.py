"""Characters outside the vocabulary name where they are: every reader of records (JSONL conversations, preference
pairs, GRPO prompts, text files, parallel files) gives a one-line error naming ``path:line`` of the first record that
cannot be encoded, and a fine-tuning run adds the checkpoint whose tokenizer lacks them and the setting that chose
it (``train.init_from``)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import yaml
from tests.tasks.preference_helpers import make_lm_checkpoint

from tokenloom.checkpoint import load_tokenizer
from tokenloom.cli.main import main
from tokenloom.data.chat import DefaultChatTemplate, read_conversations
from tokenloom.data.jsonl import record_errors
from tokenloom.data.pairs import read_preferences
from tokenloom.data.parallel import ParallelDataset
from tokenloom.data.text import TextDataset
from tokenloom.data.tokenizers import Tokenizer
from tokenloom.errors import DataError, TokenizerError, VocabularyError
from tokenloom.tasks.preference_data import encode_items
from tokenloom.tasks.sft import encode_examples

ALPHABET = "System: User: Assistant: \nabcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?0123456789"


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text
    return text


@pytest.fixture
def tok() -> Tokenizer:
    return Tokenizer.train_char(ALPHABET)


def test_record_errors_prefixes_the_record_and_keeps_the_class(tok):
    with pytest.raises(VocabularyError) as info, record_errors("x.jsonl:3"):
        tok.encode("caf\u00e9")
    assert _one_line(info.value) == ("x.jsonl:3: text contains characters outside the vocabulary: '\u00e9' (the "
                                     f"tokenizer knows {len(set(ALPHABET))} characters)")
    assert isinstance(info.value, DataError) and isinstance(info.value, TokenizerError)
    with pytest.raises(TokenizerError, match=r"^x.jsonl:3: boom$"), record_errors("x.jsonl:3"):
        raise TokenizerError("x.jsonl:3: boom")  # named once


def test_sft_conversations_name_the_line(tmp_path, tok):
    path = _jsonl(tmp_path / "chats.jsonl", [{"prompt": "say a", "response": "a"}, {"prompt": "say b", "response": "b"},
                                             {"prompt": "say \u00e9", "response": "\u00e9"}])
    with pytest.raises(VocabularyError) as info:
        encode_examples(read_conversations(path), DefaultChatTemplate(tok), tok, 64)
    assert _one_line(info.value).startswith(f"{path}:3: text contains characters outside the vocabulary: '\u00e9'")


def test_preference_pairs_name_the_line(tmp_path, tok):
    rows = [{"prompt": f"say {w}", "chosen": w, "rejected": w + "x"} for w in ("a", "b")]
    path = _jsonl(tmp_path / "pairs.jsonl", [*rows, {"prompt": "say j", "chosen": "j\u00e9", "rejected": "j"}])
    with pytest.raises(VocabularyError, match=rf"^{re.escape(str(path))}:3: text contains characters outside"):
        encode_items(read_preferences(path), DefaultChatTemplate(tok), tok, 64, kto=False)


def test_text_and_parallel_files_name_the_line(tmp_path, tok):
    text = tmp_path / "corpus.txt"
    text.write_text("first line\nsecond line\nthird \u00e9 line\nfourth\n", encoding="utf-8")
    with pytest.raises(DataError) as info:
        TextDataset.prepare(text, tok, tmp_path / "prepared")
    assert _one_line(info.value).startswith(f"{text}:3: text contains characters outside the vocabulary: '\u00e9'")
    src, tgt = tmp_path / "train.src", tmp_path / "train.tgt"
    src.write_text("a b\n\nc d\ne \u00e9\n", encoding="utf-8")  # line 2 empty (skipped): the bad pair is line 4
    tgt.write_text("x y\nz\nw v\nu t\n", encoding="utf-8")
    with warnings.catch_warnings(), pytest.raises(DataError) as info:
        warnings.simplefilter("ignore")
        ParallelDataset.prepare({"train": (src, tgt)}, tok, tmp_path / "cache", max_source_len=16,
                                max_target_len=16, empty_lines="skip")
    assert _one_line(info.value).startswith(f"{src}:4: text contains characters outside the vocabulary: '\u00e9'")


@pytest.mark.parametrize("task", ["dpo", "reward", "grpo", "sft"])
def test_fine_tuning_names_the_file_line_checkpoint_and_setting(tmp_path, task, capsys):
    """`tokenloom train` from a checkpoint whose tokenizer lacks a character of the data's third line: one line naming
    the file and line 3, the checkpoint's tokenizer and train.init_from."""
    start = make_lm_checkpoint(tmp_path / "start")
    assert load_tokenizer(start).origin == str(start)
    words = ["cat", "dog", "caf\u00e9", "sun"]
    if task in ("dpo", "reward"):
        rows = [{"prompt": f"say {w}", "chosen": w, "rejected": w + " no"} for w in words]
        data = {"path": str(_jsonl(tmp_path / "data.jsonl", rows))}
    elif task == "grpo":
        rows = [{"prompt": f"say {w}", "answer": "x"} for w in words]
        data = {"path": str(_jsonl(tmp_path / "data.jsonl", rows)), "rewards": [{"name": "exact"}], "group_size": 2}
    else:
        rows = [{"prompt": f"say {w}", "response": w} for w in words]
        data = {"path": str(_jsonl(tmp_path / "data.jsonl", rows))}
    recipe = {"task": task, "data": {**data, "val_fraction": 0.25},
              "train": {"init_from": str(start), "max_steps": 1, "batch_size": 2, "seq_len": 32}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(tmp_path / "recipe.yaml"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err == (f"error: {tmp_path / 'data.jsonl'}:3: text contains characters outside the vocabulary: '\u00e9' "
                   f"(the tokenizer of {start} knows {len(set(ALPHABET))} characters); train.init_from={start} fixes "
                   "the tokenizer: start from a model trained on data that has these characters")
