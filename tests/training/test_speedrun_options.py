"""The speedrun building blocks, each off by default: train.optimizer muon, train.schedule wsd, train.z_loss."""

import pytest
import torch
from tests.training.test_trainer import params, recipe, run

from tokenloom.errors import ConfigError
from tokenloom.models import GPT, GPTConfig
from tokenloom.tasks.losses import z_loss
from tokenloom.training import load_run_config
from tokenloom.training.optim import MuonWithAdamW, create_optimizer, hidden_matrices
from tokenloom.training.schedules import create_scheduler


def tiny_gpt(**changes):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=23, num_layers=2, num_heads=2, embed_dim=32, max_seq_len=16, dropout=0.0,
                         **changes))


def muon(model, lr=1e-2, muon_lr=0.02):
    return create_optimizer(model, lr=lr, weight_decay=0.1, betas=(0.9, 0.99), optimizer="muon", muon_lr=muon_lr,
                            hidden=hidden_matrices(model))


@pytest.mark.parametrize("tied", [True, False])
def test_muon_takes_the_block_matrices_and_adamw_everything_else(tied):
    model = tiny_gpt(tie_embeddings=tied)
    opt = muon(model)
    assert isinstance(opt, MuonWithAdamW)
    groups = [[id(p) for p in g["params"]] for g in opt.param_groups]
    seen = [i for g in groups for i in g]
    assert sorted(seen) == sorted({id(p) for p in model.parameters()})  # every parameter exactly once
    in_muon = set(groups[-1])
    names = {id(p): n for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        hidden = name.startswith("blocks.") and p.dim() == 2 and "norm" not in name
        assert (id(p) in in_muon) == hidden, name
    assert all(names[i].startswith("blocks.") for i in in_muon) and in_muon
    assert opt.param_groups[-1]["lr"] == 0.02 and all(g["lr"] == 1e-2 for g in opt.param_groups[:-1])


def test_one_schedule_drives_both_learning_rates():
    opt = muon(tiny_gpt())
    sched = create_scheduler(opt, "linear", warmup_steps=4, max_steps=10, min_ratio=0.1)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2.5e-3, 2.5e-3, 5e-3])
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-3, 5e-3, 1e-2])


def test_muon_lowers_the_loss_on_a_fixed_batch():
    model = tiny_gpt()
    opt = muon(model, lr=3e-3)
    x = torch.randint(0, 23, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.5 * losses[0]


def test_muon_state_round_trips_through_state_dict():
    model = tiny_gpt()
    opt = muon(model)
    x = torch.randint(0, 23, (2, 8))
    model(x).logsumexp(-1).mean().backward()
    opt.step()
    other = muon(model)
    other.load_state_dict(opt.state_dict())
    assert other.muon.state is other.state and other.adamw.param_groups[0] is other.param_groups[0]
    assert str(other.state_dict()) == str(opt.state_dict())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_muon_resume_is_exact(tmp_path, precision):
    cfg = recipe(tmp_path, precision=precision, optimizer="muon", schedule="wsd", z_loss=1e-4)
    full, _ = run(cfg, tmp_path / "full")
    _, first = run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=4"])
    assert first["step"] == 4
    resumed, _ = run(cfg, tmp_path / "split", resume=True)
    assert resumed.step == 8 and isinstance(resumed.optimizer, MuonWithAdamW)
    a, b = params(full.model), params(resumed.model)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("key,value,match", [
    ("optimizer", "mon", r"train.optimizer must be one of adamw, muon, got 'mon'"),
    ("muon_lr", 0.0, r"train.muon_lr must be positive, got 0.0"),
    ("decay_fraction", 1.5, r"train.decay_fraction must be in \[0, 1\], got 1.5"),
    ("z_loss", -1.0, r"train.z_loss must be >= 0"),
])
def test_the_new_keys_are_checked_by_name(tmp_path, key, value, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config(recipe(tmp_path, **{key: value}))


def test_the_defaults_change_nothing(tmp_path):
    train = load_run_config(recipe(tmp_path)).train
    assert (train.optimizer, train.z_loss) == ("adamw", 0.0)


def test_z_loss_is_the_formula():
    logits = torch.randn(2, 3, 7)
    z = torch.log(torch.exp(logits).sum(-1))
    assert z_loss(logits) == pytest.approx(float((z ** 2).mean()), rel=1e-6)


def test_the_lm_task_adds_z_loss_to_its_training_loss():
    from tokenloom.tasks.lm import LMTask

    model = tiny_gpt().eval()
    x = torch.randint(0, 23, (2, 9), generator=torch.Generator().manual_seed(2))
    batch = (x[:, :-1], x[:, 1:])
    plain = LMTask(None, batch_size=2, seq_len=8)
    with_z = LMTask(None, batch_size=2, seq_len=8, z_loss=1e-2)
    logits = model(batch[0])
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten()) + \
        1e-2 * (logits.logsumexp(-1) ** 2).mean()
    assert with_z.loss(model, batch)[0].item() == pytest.approx(expected.item(), rel=1e-5)
    assert plain.loss(model, batch)[0].item() < with_z.loss(model, batch)[0].item()


def test_z_loss_is_refused_outside_the_lm_task(tmp_path):
    cfg = recipe(tmp_path, z_loss=1e-4)
    cfg["task"] = "translation"
    with pytest.raises(ConfigError, match="train.z_loss applies to language-model training"):
        load_run_config(cfg)
