"""The speedrun building blocks, each off by default: train.optimizer muon, train.schedule wsd, train.z_loss."""

import pytest
import torch
from tests.training.test_trainer import params, recipe, run

from tokenloom.errors import ConfigError
from tokenloom.models import GPT, GPTConfig
from tokenloom.tasks.losses import z_loss
from tokenloom.training import (
    load_run_config,
    optim,
)
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
    ("decay_fraction", 1.5, r"train.decay_fraction must be in \(0, 1\], got 1.5"),
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


# -- Muon written out (torch.optim.Muon as torch 2.13 implements it: torch/optim/_muon.py) ---------------------------
def newton_schulz(update, dtype=torch.bfloat16):
    """5 steps of the quintic Newton-Schulz iteration (a, b, c) = (3.4445, -4.7750, 2.0315) in ``dtype`` (torch's:
    bfloat16), on the wide orientation: X <- a X + (b A + c A A) X with A = X X^T, X starting at G / max(||G||_F,
    1e-7)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=1e-7))
    for _ in range(5):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a X + (b A + c A A) X
    return x.T if tall else x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_muons_update_is_newton_schulz_of_the_nesterov_momentum(dtype, monkeypatch):
    """bf16: torch.optim.Muon's own step; float32 (CPUs whose bf16 products are slow): tokenloom's written-out one."""
    monkeypatch.setattr(optim, "newton_schulz_dtype", lambda params: dtype)
    model = tiny_gpt()
    opt = muon(model, muon_lr=0.02)
    hidden = hidden_matrices(model)
    shapes = {tuple(p.shape) for p in hidden}
    assert any(r > c for r, c in shapes) and any(r <= c for r, c in shapes)  # both orientations are checked
    gen = torch.Generator().manual_seed(3)
    buffers = {id(p): torch.zeros_like(p) for p in hidden}
    for _ in range(3):  # the momentum buffer carries over the steps
        before = {id(p): p.detach().clone() for p in hidden}
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        for p in hidden:
            g, buf = p.grad, buffers[id(p)]
            buf.mul_(0.95).add_(g, alpha=0.05)  # B = 0.95 B + 0.05 g (torch: buf.lerp_(g, 1 - momentum))
            nesterov = g.lerp(buf, 0.95)  # 0.05 g + 0.95 B
            rows, cols = p.shape
            expected = before[id(p)] - 0.02 * max(1.0, rows / cols) ** 0.5 * newton_schulz(nesterov, dtype).float()
            torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)


def test_an_encoder_decoders_muon_group_is_its_encoder_and_decoder_projections():
    """Declared stacks (models.protocol.BlockStacks): every Linear weight in the encoder's and the decoder's blocks,
    self- and cross-attention and MLP, goes to Muon; embeddings, the (tied) head and the norms stay with AdamW."""
    from tokenloom.models import EncoderDecoder, Seq2SeqConfig

    model = EncoderDecoder(Seq2SeqConfig(vocab_size=50, encoder_layers=2, decoder_layers=2, num_heads=2, embed_dim=16,
                                         max_source_len=8, max_target_len=8))
    in_muon = {id(p) for p in hidden_matrices(model)}
    names = {name for name, p in model.named_parameters() if id(p) in in_muon}
    expected = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
                and name.startswith(("encoder.", "decoder."))}
    assert names == {f"{name}.weight" for name in expected}
    assert any(".cross" in name for name in names), names  # the decoder's cross-attention too
    assert not {name for name in names if "embed" in name or "norm" in name or "lm_head" in name}


def test_hidden_matrices_are_the_muon_group_and_the_rest_adamw_in_bf16_training(tmp_path):
    cfg = recipe(tmp_path, precision="bf16", optimizer="muon", max_steps=1, eval_every=0, checkpoint_every=0)
    trainer, _ = run(cfg, tmp_path / "r")
    masters = trainer.master.masters
    groups = [[id(p) for p in g["params"]] for g in trainer.optimizer.param_groups]
    flat = [i for g in groups for i in g]
    assert len(flat) == len(set(flat)) == len(masters) and set(flat) == {id(m) for m in masters}
    assert set(groups[-1]) == {id(trainer.master.master_of(p)) for p in hidden_matrices(trainer.model)}


# -- bad input, one line each -------------------------------------------------------------------------------------
def test_muon_on_a_model_without_block_matrices_is_one_line(tmp_path):
    from types import SimpleNamespace

    from tokenloom.training.trainer import Trainer

    config = load_run_config(recipe(tmp_path, optimizer="muon"))
    with pytest.raises(ConfigError, match=r"^train.optimizer=muon: this Linear model has no trainable 2-D weights "
                                          r"in its block stacks .*use train.optimizer adamw$") as err:
        Trainer(config, torch.nn.Linear(4, 4), SimpleNamespace(), tmp_path / "r")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("changes,match", [
    ({"schedule": "wsd", "max_steps": 10, "warmup_steps": 5, "decay_fraction": 0.6},
     r"^train.schedule wsd: train.warmup_steps \(5\) \+ train.decay_fraction \(0.6\) x train.max_steps \(10\) = 11 is "
     r"more than train.max_steps; lower warmup_steps or decay_fraction$"),
    ({"schedule": "wsd", "decay_fraction": 0.0}, r"^train.decay_fraction must be in \(0, 1\], got 0.0$"),
    ({"decay_fraction": 1.5}, r"^train.decay_fraction must be in \(0, 1\], got 1.5$"),
    ({"optimizer": "lion"}, r"^train.optimizer must be one of adamw, muon, got 'lion'"),
    ({"ema": 1.0}, r"^train.ema must be a decay in \[0, 1\) \(0 = off\), got 1.0$"),
    ({"ema": -0.1}, r"^train.ema must be a decay in \[0, 1\) \(0 = off\), got -0.1$"),
    ({"seq_len_warmup": -1}, r"^train.seq_len_warmup must be an integer >= 0 \(0 = off\), got -1$"),
    ({"seq_len_warmup": 4, "seq_len_start": 32}, r"^train.seq_len_start \(32\) must be <= the training length "
                                                 r"\(train.seq_len = 16\): lower train.seq_len_start "
                                                 r"or set train.seq_len_warmup to 0$"),
    ({"compile": "optimizer"}, r"train.compile"),
])
def test_bad_speedrun_settings_are_one_line_naming_the_field(tmp_path, changes, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_run_config(recipe(tmp_path, **changes))
    assert "\n" not in str(err.value)


def test_wsd_phases_that_fit_are_accepted(tmp_path):
    train = load_run_config(recipe(tmp_path, schedule="wsd", max_steps=10, warmup_steps=5, decay_fraction=0.5)).train
    assert (train.warmup_steps, train.decay_fraction) == (5, 0.5)


@pytest.mark.parametrize("where,change,match", [
    ("task", "translation", r"train.seq_len_warmup=4 applies to language-model training \(task lm\), not "
                            r"'translation'"),
    ("data", {"order": "stream"}, r"^train.seq_len_warmup=4 draws windows at random offsets; data.order: stream"),
])
def test_seq_len_warmup_is_refused_where_it_cannot_apply(tmp_path, where, change, match):
    cfg = recipe(tmp_path, seq_len_warmup=4, seq_len_start=8)
    if where == "task":
        cfg["task"] = change
    else:
        cfg["data"].update(change)
    with pytest.raises(ConfigError, match=match):
        load_run_config(cfg)


# -- train.ema ----------------------------------------------------------------------------------------------------
def test_the_weight_average_is_the_formula():
    from tokenloom.training.ema import WeightAverage

    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    ema = WeightAverage([w], decay=0.5)
    expected = w.detach().clone()
    for t, value in enumerate([3.0, 5.0, -1.0, 0.5]):
        with torch.no_grad():
            w.fill_(value)
        ema.update()
        d = min(0.5, (1 + t) / (10 + t))
        expected = d * expected + (1 - d) * w.detach()
        torch.testing.assert_close(ema.average[0], expected, rtol=1e-6, atol=0)
    raw = w.detach().clone()
    with ema.swapped():
        assert torch.equal(w.detach(), ema.average[0])
    assert torch.equal(w.detach(), raw)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ema_resume_is_exact_and_the_checkpoint_holds_the_average(tmp_path, precision):
    from safetensors.torch import load_file

    cfg = recipe(tmp_path, precision=precision, ema=0.9)
    full, whole = run(cfg, tmp_path / "full")
    _, first = run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=3"])
    assert first["step"] == 3
    resumed, _ = run(cfg, tmp_path / "split", resume=True)
    assert resumed.step == 8 and resumed.ema.updates == full.ema.updates == 8
    a, b = params(full.model), params(resumed.model)  # the raw weights training continues from
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for x, y in zip(full.ema.average, resumed.ema.average, strict=True):
        assert torch.equal(x, y)
    assert full.last_eval == resumed.last_eval
    saved = load_file(str(tmp_path / "full" / "checkpoint" / "model.safetensors"))
    names = full._ema_names()
    for name, average in zip(names, full.ema.average, strict=True):
        assert torch.equal(saved[name], average), name  # model.safetensors: the average
    assert any(not torch.equal(saved[name], a[name]) for name in names)  # ... not the raw weights
    from tokenloom.nn.modes import eval_mode

    with full._averaged(), eval_mode(full.model), torch.no_grad():  # the final evaluation measured the average
        assert full.task.evaluate(full.model)["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-6)


# -- train.seq_len_warmup -----------------------------------------------------------------------------------------
def test_the_training_length_grows_in_multiples_of_the_start():
    from tokenloom.tasks.lm import LMTask

    task = LMTask(None, batch_size=2, seq_len=256, seq_len_warmup=10, seq_len_start=64)
    lengths = [task.train_seq_len(step) for step in range(12)]
    assert lengths == [64, 64, 64, 64, 128, 128, 128, 192, 192, 192, 256, 256]
    for step, length in enumerate(lengths[:10]):  # max(s0, floor((s0 + (T - s0) * step / N) / s0) * s0)
        assert length == max(64, int((64 + 192 * step / 10) // 64) * 64)
    assert LMTask(None, batch_size=2, seq_len=256).train_seq_len(0) == 256  # off: the full length


def test_seq_len_warmup_trains_short_windows_first_and_resumes_exactly(tmp_path):
    cfg = recipe(tmp_path, seq_len_warmup=4, seq_len_start=4)
    full, whole = run(cfg, tmp_path / "full")
    # steps 0..3 at 4, 7, 10, 13 -> multiples of 4: 4, 4, 8, 12; then 16; batch 4
    assert whole["tokens"] == 4 * (4 + 4 + 8 + 12 + 4 * 16)
    _, first = run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=2"])
    resumed, rest = run(cfg, tmp_path / "split", resume=True)
    assert rest["tokens"] == whole["tokens"]
    a, b = params(full.model), params(resumed.model)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert full.last_eval == resumed.last_eval
