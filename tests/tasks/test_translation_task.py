"""TranslationTask: batches, loss, scheduled sampling."""

import random

import pytest
import torch

from tokenloom.tasks.translation import TranslationDataConfig, TranslationTask
from tokenloom.training.config import ScheduledSamplingConfig


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tt")
    rng = random.Random(0)
    words = "red blue green house dog cat runs sleeps".split()
    for name, n in (("train", 200), ("val", 20)):
        pairs = [rng.choices(words, k=rng.randint(2, 6)) for _ in range(n)]
        (root / f"{name}.xx").write_text("".join(" ".join(p) + "\n" for p in pairs))
        (root / f"{name}.yy").write_text("".join(" ".join(reversed(p)).upper() + "\n" for p in pairs))
    data = TranslationDataConfig(dir=str(root), source_lang="xx", target_lang="yy", test=[], vocab_size=300,
                                 max_source_len=32, max_target_len=32, max_tokens=256, bleu=False)
    task, model, _, section = TranslationTask.setup(
        data, {"encoder_layers": 1, "decoder_layers": 1, "num_heads": 2, "embed_dim": 32, "dropout": 0.0},
        root, batch_size=1, seq_len=None, label_smoothing=0.1, eval_batches=None)
    assert section["family"] == "seq2seq" and section["pad_id"] == 0 and section["eos_id"] == 2
    return task, model


def test_batches_respect_the_token_budget_and_cover_an_epoch(task):
    task, _ = task
    seen = []
    n_batches = len(task._epoch_batches())
    for _ in range(n_batches):
        batch = task.get_batch()
        assert batch.source.numel() <= 256 or batch.source.shape[0] == 1
        assert (batch.target_in[:, 0] == 1).all()
        seen += batch.indices.tolist()
    assert sorted(seen) == list(range(task.dataset.num_pairs("train")))
    task.get_batch()
    assert task.epoch == 1 and task.position == 1


def test_scheduled_sampling_with_probability_zero_is_teacher_forcing(task):
    task, model = task
    batch = task.get_batch()
    model.eval()  # no dropout: the passes are comparable
    with torch.no_grad():
        gold = model(batch.source, batch.target_in, batch.source_mask)
        same = task._scheduled_sampling_logits(model, batch, replace=0.0)
        mixed = task._scheduled_sampling_logits(model, batch, replace=1.0)
    torch.testing.assert_close(same, gold)
    assert not torch.allclose(mixed, gold)  # the inputs really changed
    # padding positions of the logits see the same (causal) prefix only where nothing was replaced
    torch.testing.assert_close(mixed[:, 0], gold[:, 0])  # position 0 reads BOS either way


def test_teacher_probability_schedules():
    assert ScheduledSamplingConfig().teacher_probability(10 ** 6) == 1.0
    lin = ScheduledSamplingConfig(schedule="linear", k=100, min_teacher=0.5)
    assert [lin.teacher_probability(s) for s in (0, 25, 100)] == [1.0, 0.75, 0.5]
    exp = ScheduledSamplingConfig(schedule="exponential", k=0.99, min_teacher=0.0)
    assert exp.teacher_probability(100) == pytest.approx(0.99 ** 100)
    sig = ScheduledSamplingConfig(schedule="inverse_sigmoid", k=10, min_teacher=0.0)
    assert sig.teacher_probability(0) == pytest.approx(10 / 11)
    assert sig.teacher_probability(10 ** 6) < 1e-100
