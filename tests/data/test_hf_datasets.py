"""``data.format: hf``: the lm, sft and translation tasks train on local JSON Lines, Parquet and ``save_to_disk`` data
read with Hugging Face ``datasets`` -- through the native readers' pipeline, never the network -- and a missing column
or a non-local name is one line naming the setting."""

from __future__ import annotations

import json
import random

import pytest
import yaml

from tokenloom.checkpoint import read_config
from tokenloom.cli.main import main
from tokenloom.config import from_dict
from tokenloom.errors import ConfigError, DataError
from tokenloom.tasks.lm import LMDataConfig, text_file
from tokenloom.tasks.sft import SFTDataConfig, data_conversations
from tokenloom.tasks.translation import TranslationDataConfig

datasets = pytest.importorskip("datasets")

WORDS = "red blue green house dog cat runs sleeps the a big small".split()
TRAIN = {"max_steps": 2, "batch_size": 2, "seq_len": 16, "lr": 3e-3, "warmup_steps": 1, "eval_every": 0,
         "eval_batches": 1, "checkpoint_every": 0, "precision": "fp32"}
GPT = {"num_layers": 1, "num_heads": 2, "embed_dim": 32, "max_seq_len": 64, "dropout": 0.0}


@pytest.fixture(autouse=True)
def offline(no_network):
    """Nothing here may touch the network (tests/conftest.py's no_network, for every test of the file)."""


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 8))) for _ in range(n)]


def _train(tmp_path, recipe: dict, name: str = "run") -> int:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return main(["train", str(path), "--out", str(tmp_path / name)])


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err.removeprefix("error: ")


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_lm_trains_on_a_jsonl_or_parquet_table(tmp_path, capsys, suffix):
    docs = _sentences(120)
    rows = [{"id": i, "body": doc} for i, doc in enumerate(docs)]
    path = tmp_path / f"corpus.{suffix}"
    if suffix == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    recipe = {"model": GPT, "data": {"path": str(path), "format": "hf", "text_field": "body"}, "train": TRAIN}
    assert _train(tmp_path, recipe) == 0
    # the documents, one a line, went through the text format's pipeline (memmaps, reuse)
    text = tmp_path / "run" / "data" / "hf" / "text.txt"
    assert text.read_text() == "".join(d + "\n" for d in docs)
    stamp = text.stat().st_mtime_ns  # read again (a resumed run): the file stays as it was, so its cache is reused
    assert text_file(from_dict(LMDataConfig, recipe["data"], prefix="data"), tmp_path / "run" / "data") == text
    assert text.stat().st_mtime_ns == stamp
    assert read_config(tmp_path / "run")["data"]["format"] == "hf"
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "run"), "--json", "--batches", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] > 0


def test_sft_trains_on_a_save_to_disk_folder(tmp_path, capsys):
    rows = [{"messages": [{"role": "user", "content": f"Reverse: {s}"},
                          {"role": "assistant", "content": " ".join(reversed(s.split()))}]} for s in _sentences(12)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "chats"))
    recipe = {"task": "sft", "model": {**GPT, "max_seq_len": 128},
              "data": {"path": str(tmp_path / "chats"), "format": "hf", "val_fraction": 0.25},
              "train": {**TRAIN, "seq_len": 128}}
    assert _train(tmp_path, recipe) == 0
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "run"), "--json"]) == 0  # the same conversations, read again
    assert json.loads(capsys.readouterr().out)["val_loss"] > 0


def test_sft_reads_prompt_and_response_columns_and_dataset_dict_splits(tmp_path):
    table = datasets.Dataset.from_dict({"q": ["Add 1 and 1", "Add 2 and 2"], "a": ["2", "4"]})
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(str(tmp_path / "dd"))
    data = SFTDataConfig(path=str(tmp_path / "dd"), format="hf", prompt_field="q", response_field="a")
    conversations = data_conversations(data, data.path)
    assert [c.messages for c in conversations][1] == [{"role": "user", "content": "Add 2 and 2"},
                                                      {"role": "assistant", "content": "4"}]
    assert conversations[0].where == f"{tmp_path / 'dd'}[train][0]"
    with pytest.raises(DataError, match=r"data.messages_field='messages' is not a column of .*, nor are "
                                        r"data.prompt_field='prompt' and data.response_field='a' \(columns: q, a\)"):
        data_conversations(SFTDataConfig(path=data.path, format="hf", response_field="a"), data.path)


def _pairs(n: int, seed: int) -> list[tuple[str, str]]:
    return [(s, " ".join(w.upper() for w in reversed(s.split()))) for s in _sentences(n, seed)]


def test_translation_trains_on_parquet_splits(tmp_path, capsys):
    folder = tmp_path / "para"
    folder.mkdir()
    for split, n, seed in (("train", 200, 0), ("val", 12, 1)):
        pairs = _pairs(n, seed)
        datasets.Dataset.from_dict({"src": [p[0] for p in pairs], "tgt": [p[1] for p in pairs]}).to_parquet(
            str(folder / f"{split}.parquet"))
    recipe = {"task": "translation",
              "model": {"encoder_layers": 1, "decoder_layers": 1, "num_heads": 2, "embed_dim": 32, "dropout": 0.0},
              "data": {"dir": str(folder), "format": "hf", "source_field": "src", "target_field": "tgt",
                       "source_lang": "xx", "target_lang": "yy", "test": [], "vocab_size": 300, "max_source_len": 32,
                       "max_target_len": 32, "max_tokens": 256, "bleu": False},
              "train": {**TRAIN, "eval_every": 2}}
    assert _train(tmp_path, recipe) == 0
    written = (tmp_path / "run" / "data" / "hf" / "val.yy").read_text().splitlines()
    assert written == [p[1] for p in _pairs(12, 1)]
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "run"), "--split", "val", "--beam", "1", "--json"]) == 0
    assert "12 sentences" in json.loads(capsys.readouterr().out)["data"]


def test_translation_reads_a_wmt_style_translation_column(tmp_path):
    rows = [{"translation": {"de": f"satz {i}\nzwei", "en": f"sentence {i}"}} for i in range(3)]
    table = datasets.Dataset.from_list(rows)
    datasets.DatasetDict({"train": table, "validation": table}).save_to_disk(str(tmp_path / "wmt"))
    data = TranslationDataConfig(dir=str(tmp_path / "wmt"), format="hf", valid="validation", test=[])
    assert data.read_pairs("validation") == [(f"satz {i} zwei", f"sentence {i}") for i in range(3)]
    with pytest.raises(DataError, match=r"data.source_lang='fr' is not a language of column 'translation' "
                                        r"\(languages: de, en\)"):
        TranslationDataConfig(dir=data.dir, format="hf", source_lang="fr", test=[]).read_pairs("train")
    with pytest.raises(DataError, match=r"data.test='test2016' is not a split of"):
        data.read_pairs("test2016")


def test_a_missing_column_or_a_remote_name_is_one_line(tmp_path, capsys):
    path = tmp_path / "x.parquet"
    datasets.Dataset.from_dict({"a": ["one", "two"], "b": [1, 2]}).to_parquet(str(path))
    capsys.readouterr()  # (the progress bar of writing it)
    recipe = {"model": GPT, "data": {"path": str(path), "format": "hf"}, "train": TRAIN}
    assert _train(tmp_path, recipe) == 2
    assert _error(capsys) == f"data.text_field='text' is not a column of {path} (columns: a, b)"
    recipe["data"]["text_field"] = "b"
    assert _train(tmp_path, recipe) == 2
    assert _error(capsys) == f"{path}[0]: data.text_field='b' holds int '1', not text"
    recipe["data"] = {"path": "wikitext", "format": "hf"}  # a hub name: never downloaded
    assert _train(tmp_path, recipe) == 2
    assert _error(capsys).startswith("data.path='wikitext' is not a local file or folder")
    folder = tmp_path / "para"
    folder.mkdir()
    datasets.Dataset.from_dict({"source": ["a b"], "en": ["A B"]}).to_json(str(folder / "train.jsonl"))
    with pytest.raises(DataError) as err:
        TranslationDataConfig(dir=str(folder), format="hf").read_pairs("train")
    assert str(err.value) == (f"data.target_field='target' is not a column of {folder / 'train.jsonl'}, nor is "
                              "data.translation_field='translation' (columns: source, en)")


def test_format_is_validated():
    for cls, field in ((SFTDataConfig, "jsonl"), (TranslationDataConfig, "text")):
        with pytest.raises(ConfigError, match=f"data.format must be one of {field}, hf, got 'csv'"):
            from_dict(cls, {"format": "csv"}, prefix="data")
    with pytest.raises(ConfigError, match="data.text_field must name a column, got ''"):
        from_dict(LMDataConfig, {"text_field": ""}, prefix="data")
