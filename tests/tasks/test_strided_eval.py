"""Strided (sliding-window) perplexity: every target scored once, each with the context the stride promises, equal to
a token-by-token reference, and equal to the plain non-overlapping evaluation when the stride is the window."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from tokenloom.cli.main import main
from tokenloom.data.text import TextDataset
from tokenloom.data.tokenizers import create_tokenizer
from tokenloom.errors import DataError
from tokenloom.models import GPT, GPTConfig
from tokenloom.tasks import LMTask

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n" * 3
# no window of the split repeats, so a window's place in the split can be found from its tokens
_RNG = random.Random(0)
UNIQUE = "".join(_RNG.choice("abcdefghijklmnopqrstuvwxyz .,") for _ in range(600))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> TextDataset:
    root = tmp_path_factory.mktemp("strided")
    (root / "text.txt").write_text(UNIQUE)
    tok = create_tokenizer("char", UNIQUE)
    return TextDataset.prepare(root / "text.txt", tok, root / "data", val_fraction=0.5)


@pytest.fixture(scope="module")
def model(dataset) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, num_layers=2, num_heads=2, embed_dim=32, max_seq_len=16)
    return GPT(config).eval()


@pytest.mark.parametrize("seq_len,stride", [(16, 1), (16, 5), (16, 16), (7, 3), (10, 9)])
def test_every_target_is_scored_once_with_the_promised_context(dataset, seq_len, stride):
    targets = dataset.num_tokens("val") - 1
    ids = torch.from_numpy(dataset.tokens("val").astype("int64"))
    seen = []
    for x, y, scored in dataset.iter_strided("val", 4, seq_len, stride):
        assert x.shape == y.shape == scored.shape and x.shape[1] == seq_len
        for row in range(x.shape[0]):
            (start,) = [s for s in range(targets) if torch.equal(ids[s:s + seq_len], x[row])][:1]
            for j in scored[row].nonzero().flatten().tolist():
                position = start + j + 1  # the index of this target in the split
                assert y[row, j] == ids[position]
                context = j + 1
                assert context >= min(position, seq_len - stride + 1)  # all before it near the start
                seen.append(position)
    assert sorted(seen) == list(range(1, targets + 1))


def _reference(model: GPT, ids: torch.Tensor, seq_len: int) -> float:
    """Each target scored with exactly the previous min(p, seq_len) tokens, one forward pass per target."""
    losses = []
    with torch.no_grad():
        for p in range(1, len(ids)):
            context = ids[max(0, p - seq_len):p]
            logits = model(context[None])[0, -1]
            losses.append(F.cross_entropy(logits[None].float(), ids[p:p + 1]).item())
    return sum(losses) / len(losses)


def test_stride_one_equals_the_token_by_token_reference(dataset, model):
    seq_len = 16
    task = LMTask(dataset, batch_size=8, seq_len=seq_len)
    metrics = task.evaluate(model, max_batches=None, split="val", stride=1)
    ids = torch.from_numpy(dataset.tokens("val").astype("int64"))
    assert metrics["tokens"] == len(ids) - 1
    assert metrics["val_loss"] == pytest.approx(_reference(model, ids, seq_len), abs=1e-4)
    assert metrics["val_ppl"] == pytest.approx(math.exp(metrics["val_loss"]))


def test_stride_equal_to_the_window_is_the_plain_evaluation_where_windows_tile_the_split(tmp_path, model):
    tok = create_tokenizer("char", TEXT)
    seq_len = 16
    text = TEXT[:4 * seq_len + 1]
    (tmp_path / "t.txt").write_text(text + text)  # val = the second half: 4 whole windows + 1 token
    ds = TextDataset.prepare(tmp_path / "t.txt", tok, tmp_path / "d", val_fraction=0.5)
    assert (ds.num_tokens("val") - 1) % seq_len == 0
    task = LMTask(ds, batch_size=3, seq_len=seq_len)
    plain = task.evaluate(model, max_batches=None, split="val")
    strided = task.evaluate(model, max_batches=None, split="val", stride=seq_len)
    assert strided["tokens"] == plain["tokens"]
    assert strided["val_loss"] == pytest.approx(plain["val_loss"], abs=1e-5)


def test_evaluate_stride_scores_every_token_of_the_split(tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text(TEXT * 8)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({
        "model": {"num_layers": 2, "num_heads": 2, "embed_dim": 32, "max_seq_len": 32},
        "data": {"path": str(tmp_path / "corpus.txt")},
        "train": {"max_steps": 20, "batch_size": 8, "lr": 3e-3, "warmup_steps": 5, "eval_every": 0,
                  "eval_batches": 1, "checkpoint_every": 0, "precision": "fp32"}}))
    assert main(["train", str(recipe), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    results = {}
    for stride in (None, 8):
        argv = ["evaluate", str(tmp_path / "run"), "--json"] + ([] if stride is None else ["--stride", str(stride)])
        assert main(argv) == 0
        results[stride] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results[8]["stride"] == 8 and results[8]["window"] == 32 and "stride" not in results[None]
    val_targets = len(TEXT * 8) - int(len(TEXT * 8) * 0.9) - 1  # the char corpus' last 10%, less one
    assert results[8]["tokens"] == val_targets  # the tail too, which whole windows leave out
    assert results[None]["tokens"] == val_targets // 32 * 32
    assert math.isfinite(results[8]["val_loss"])


@pytest.mark.parametrize("stride,message", [("0", "--stride must be >= 1"), ("33", "at most the model's window")])
def test_a_bad_stride_is_a_one_line_error(tmp_path, capsys, stride, message):
    (tmp_path / "corpus.txt").write_text(TEXT * 4)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({
        "model": {"num_layers": 1, "num_heads": 2, "embed_dim": 16, "max_seq_len": 32},
        "data": {"path": str(tmp_path / "corpus.txt")},
        "train": {"max_steps": 1, "batch_size": 2, "warmup_steps": 0, "eval_every": 0, "eval_batches": 1,
                  "checkpoint_every": 0, "precision": "fp32"}}))
    assert main(["train", str(recipe), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "run"), "--stride", stride]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_iter_strided_refuses_a_stride_outside_the_window(dataset):
    with pytest.raises(DataError, match="stride must be in"):
        next(dataset.iter_strided("val", 2, 8, 9))
