"""Transformer-XL in the LM task: contiguous streams, the memory carried across training batches and evaluation
segments, the stream position saved for resume, and the recipe checks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tokenloom.data.text import TextDataset
from tokenloom.data.tokenizers import create_tokenizer
from tokenloom.errors import ConfigError, DataError
from tokenloom.models import GPT, GPTConfig
from tokenloom.tasks import LMTask

_RNG = random.Random(0)
TEXT = "".join(_RNG.choice("abcdefghij .,\n") for _ in range(2000))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> TextDataset:
    root = tmp_path_factory.mktemp("xl")
    (root / "text.txt").write_text(TEXT)
    return TextDataset.prepare(root / "text.txt", create_tokenizer("char", TEXT), root / "data", val_fraction=0.25)


def xl_model(memory_len: int, segment: int = 8) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=16, num_layers=2, num_heads=2, embed_dim=16, max_seq_len=segment, position="xl",
                         memory_len=memory_len))


def test_stream_batches_continue_each_row(dataset):
    rows, T = 3, 8
    segments = dataset.streams("train", rows, T)
    for j in range(segments - 1):
        x0, y0 = dataset.stream_batch("train", rows, T, j)
        x1, _ = dataset.stream_batch("train", rows, T, j + 1)
        assert torch.equal(x0[:, 1:], y0[:, :-1]) and torch.equal(x1[:, 0], y0[:, -1])
    torch.testing.assert_close(dataset.stream_batch("train", rows, T, segments)[0],
                               dataset.stream_batch("train", rows, T, 0)[0])  # wraps around
    with pytest.raises(DataError, match="too few for 1000 streams"):
        dataset.streams("train", 1000, T)


def test_training_carries_the_memory_and_resets_it_when_the_streams_wrap(dataset):
    model = xl_model(memory_len=16).train()
    task = LMTask(dataset, batch_size=2, seq_len=8, order="stream", memory_len=16)
    segments = dataset.streams("train", 2, 8)
    lengths = []
    for _ in range(segments + 1):
        task.loss(model, task.get_batch(torch.Generator()))
        lengths.append(task.memory.length)
    assert lengths[:3] == [8, 16, 24] and lengths[segments] == 8  # forgotten at the wrap
    state = task.state_dict()
    assert state["epoch"] == 1 and state["segment"] == 1 and 0 <= state["offset"] < 8  # the second pass, shifted
    x, _ = task.get_batch(torch.Generator())
    per_row = (dataset.num_tokens("train") - 1) // 2
    ids = torch.from_numpy(dataset.tokens("train").astype("int64"))
    assert torch.equal(x[1], ids[per_row + state["offset"] + 8:per_row + state["offset"] + 16])
    task.load_state_dict({"epoch": 1, "segment": 5, "offset": 3})
    assert (task.epoch, task.segment, task.offset) == (1, 5, 3)
    assert task.memory is None  # resume: the stream continues, the memory starts empty


def test_evaluation_with_memory_equals_one_forward_over_each_stream(dataset):
    """A memory longer than the streams keeps everything: the segments' losses are one causal forward's."""
    model = xl_model(memory_len=10_000).eval()
    task = LMTask(dataset, batch_size=2, seq_len=8, order="stream", memory_len=10_000)
    result = task.evaluate(model, max_batches=None)
    segments = dataset.streams("val", 2, 8)
    ids = torch.from_numpy(dataset.tokens("val").astype("int64"))
    per_row = (ids.numel() - 1) // 2
    losses = []
    with torch.no_grad():
        for r in range(2):
            x = ids[r * per_row:r * per_row + segments * 8]
            y = ids[r * per_row + 1:r * per_row + segments * 8 + 1]
            losses.append(F.cross_entropy(model(x[None])[0], y, reduction="sum"))
    assert result["tokens"] == 2 * segments * 8
    assert result["val_loss"] == pytest.approx(float(sum(losses)) / result["tokens"], rel=1e-5)
    with pytest.raises(DataError, match="leave out --stride"):
        task.evaluate(model, stride=4)


def test_memory_needs_the_stream_order(dataset):
    with pytest.raises(ConfigError, match="needs data.order: stream"):
        LMTask(dataset, batch_size=2, seq_len=8, memory_len=16)


@pytest.mark.parametrize("name,field", [("shakespeare-char-xl", "memory_len"),
                                        ("shakespeare-char-swa", "attention_window")])
def test_the_recipes_load(name, field):
    from pathlib import Path

    from tokenloom.models.factory import model_config_from_dict
    from tokenloom.training.config import load_run_config

    config = load_run_config(Path(__file__).parents[2] / "configs" / f"{name}.yaml")
    _, model_config = model_config_from_dict({**config.model, "vocab_size": 65})
    assert getattr(model_config, field)
