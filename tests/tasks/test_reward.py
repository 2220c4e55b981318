"""Reward model: the Bradley-Terry loss, a language model's backbone loaded with a fresh head, a tiny model that
ranks a few pairs perfectly, scores blind to padding (batched == alone, either side), and the scoring helpers."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from tests.tasks.preference_helpers import PAIRS, make_lm_checkpoint, run, write_jsonl
from tokenloom.checkpoint import load_model, load_tokenizer
from tokenloom.errors import CheckpointError, ConfigError
from tokenloom.models.gpt import GPTConfig
from tokenloom.models.reward import GPTReward, last_token_index, reward_family
from tokenloom.tasks.reward import RewardScorer, bradley_terry_loss, load_scorer, score


def test_bradley_terry_loss_equals_the_formula():
    gen = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    loss, m = bradley_terry_loss(chosen, rejected)
    pairs = zip(chosen.tolist(), rejected.tolist(), strict=True)
    expected = sum(-math.log(1 / (1 + math.exp(-(c - r)))) for c, r in pairs) / 7
    assert math.isclose(float(loss), expected, rel_tol=1e-6)
    assert float(m["acc"]) == float((chosen > rejected).float().mean())
    assert torch.allclose(m["margin"], (chosen - rejected).mean())


def test_the_last_token_index_follows_the_mask_on_either_side():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert last_token_index(right, 5, 2, torch.device("cpu")).tolist() == [2, 4]
    assert last_token_index(left, 5, 2, torch.device("cpu")).tolist() == [4, 4]
    assert last_token_index(None, 5, 2, torch.device("cpu")).tolist() == [4, 4]


def test_scores_ignore_padding_batched_equals_alone_on_either_side():
    torch.manual_seed(0)
    model = GPTReward(GPTConfig(vocab_size=20, num_layers=2, num_heads=2, embed_dim=32, max_seq_len=16)).eval()
    rows = [torch.randint(1, 20, (n,)) for n in (9, 4, 6)]
    alone = torch.stack([model.score(r[None])[0] for r in rows])
    T = 9
    right, left = torch.zeros(3, T, dtype=torch.long), torch.zeros(3, T, dtype=torch.long)
    right_mask, left_mask = torch.zeros_like(right), torch.zeros_like(left)
    for i, r in enumerate(rows):
        right[i, :len(r)], right_mask[i, :len(r)] = r, 1
        left[i, T - len(r):], left_mask[i, T - len(r):] = r, 1
    with torch.no_grad():
        assert torch.allclose(model.score(right, right_mask), alone, atol=1e-5)
        assert torch.allclose(model.score(left, left_mask), alone, atol=1e-5)
        # the score reads the last real token: without the mask the right-padded rows would read padding
        assert not torch.allclose(model.score(right), alone, atol=1e-3)


def test_init_from_a_language_model_loads_the_backbone_and_starts_the_head_fresh(tmp_path):
    lm = make_lm_checkpoint(tmp_path / "lm", tie_embeddings=False)
    path = str(write_jsonl(tmp_path / "p.jsonl", PAIRS))
    trainer = run("reward", {"path": path}, tmp_path / "out", init_from=lm, steps=1)
    assert isinstance(trainer.model, GPTReward) and trainer.model_section["family"] == "gpt_reward"
    source, _ = load_model(lm)
    mine = trainer.model.state_dict()
    for name, tensor in source.state_dict().items():
        assert torch.equal(mine[name], tensor), name
    assert set(mine) - set(source.state_dict()) == {"score_head.weight"}
    assert reward_family("gpt") == "gpt_reward" and reward_family("gpt_reward") == "gpt_reward"
    with pytest.raises(ConfigError, match="no reward model"):
        reward_family("seq2seq")


def test_a_tiny_reward_model_ranks_a_few_pairs_perfectly(tmp_path, capsys):
    lm = make_lm_checkpoint(tmp_path / "lm")
    path = str(write_jsonl(tmp_path / "p.jsonl", PAIRS))
    trainer = run("reward", {"path": path, "val_path": path}, tmp_path / "out", init_from=lm, steps=40)
    before = trainer.task.evaluate(trainer.model)
    after = trainer.fit()
    assert after["val_acc"] == 1.0 and after["val_loss"] < 0.1 < before["val_loss"]
    # the checkpoint scores through the helpers with the template it was trained with
    scorer = load_scorer(trainer.checkpoint_dir)
    assert isinstance(scorer, RewardScorer)
    prompts = [p["prompt"] for p in PAIRS[:3]]
    chosen = scorer(prompts, [p["chosen"] for p in PAIRS[:3]])
    rejected = scorer(prompts, [p["rejected"] for p in PAIRS[:3]])
    assert all(c > r for c, r in zip(chosen, rejected, strict=True))
    # batched (padded) == one at a time, and score() == the scorer
    replies = ["cat ok", "a longer reply, ok", "moon"]
    alone = [scorer([p], [r])[0] for p, r in zip(prompts, replies, strict=True)]
    assert scorer(prompts, replies) == pytest.approx(alone, abs=1e-5)
    model, _ = load_model(trainer.checkpoint_dir)
    tok = load_tokenizer(trainer.checkpoint_dir)
    assert score(model, tok, prompts[0], replies[0]) == pytest.approx(alone[0], abs=1e-5)
    # `tokenloom evaluate` of the checkpoint: its pairwise metrics
    import json

    from tokenloom.cli.main import main

    assert main(["evaluate", str(trainer.checkpoint_dir), "--json", "--device", "cpu", "--precision", "fp32"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["val_acc"] == 1.0 and printed["val_loss"] == pytest.approx(after["val_loss"], abs=1e-4)
    # a prompt given as messages is the same as the string (one user turn)
    assert scorer([[{"role": "user", "content": prompts[1]}]], [replies[1]])[0] == pytest.approx(alone[1], abs=1e-5)


def test_the_reward_task_and_helpers_refuse_in_one_line(tmp_path):
    path = str(write_jsonl(tmp_path / "p.jsonl", PAIRS))
    with pytest.raises(ConfigError, match="task reward needs train.init_from") as err:
        run("reward", {"path": path}, tmp_path / "out", init_from=None)
    assert "\n" not in str(err.value)
    lm = make_lm_checkpoint(tmp_path / "lm")
    with pytest.raises(CheckpointError, match="not a reward model"):
        load_scorer(lm)
    bad = write_jsonl(tmp_path / "bad.jsonl", [*PAIRS, {"prompt": "x", "chosen": "y", "rejected": "y"}])
    with pytest.raises(Exception, match=r"bad\.jsonl:9"):
        run("reward", {"path": str(bad)}, tmp_path / "out2", init_from=lm)


def test_the_pairwise_gradient_pushes_the_scores_apart():
    chosen = torch.zeros(3, requires_grad=True)
    rejected = torch.zeros(3, requires_grad=True)
    bradley_terry_loss(chosen, rejected)[0].backward()
    assert torch.allclose(chosen.grad, torch.full((3,), -0.5 / 3))  # d/dr_c of -log sigmoid(0) = -1/2
    assert torch.allclose(rejected.grad, -chosen.grad)
    assert torch.allclose(F.logsigmoid(torch.zeros(1)), torch.tensor([-math.log(2)]))
