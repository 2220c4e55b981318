"""DPO / IPO / KTO: the losses equal their formulas (and TRL's), the tied pair at the reference has no gradient,
reply-only log-probabilities, the dpo task trains, keeps its reference on resume, caches it exactly, and refuses
bad input in one line."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from tests.tasks.preference_helpers import PAIRS, make_lm_checkpoint, run, write_jsonl
from tokenloom.checkpoint import load_model, load_tokenizer
from tokenloom.data.chat import chat_template_for
from tokenloom.data.pairs import encode_reply, read_preferences
from tokenloom.errors import ConfigError, DataError
from tokenloom.tasks.preference import dpo_loss, ipo_loss, kto_loss
from tokenloom.tasks.preference_data import EncodedItem, make_batch
from tokenloom.tasks.sequences import sequence_logprobs


def logps(seed: int, n: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [-torch.rand(n, generator=gen, dtype=torch.float64) * 20 for _ in range(4)]


# ---- the losses as formulas ---------------------------------------------------------------------------------

@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_equals_the_formula_and_its_metrics(beta):
    pc, pr, rc, rr = logps(0)
    loss, m = dpo_loss(pc, pr, rc, rr, beta)
    h = (pc - pr) - (rc - rr)
    expected = sum(-math.log(1 / (1 + math.exp(-beta * float(x)))) for x in h) / len(h)
    assert math.isclose(float(loss), expected, abs_tol=1e-12)
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    assert torch.allclose(m["chosen_reward"], chosen.float().mean())
    assert torch.allclose(m["rejected_reward"], rejected.float().mean())
    assert float(m["reward_acc"]) == float((chosen > rejected).float().mean())
    assert torch.allclose(m["margin"], (chosen - rejected).float().mean())


def test_conservative_dpo_equals_trls_label_smoothing():
    # TRL's DPOTrainer.dpo_loss, loss_type "sigmoid": -logsigmoid(b h)(1 - eps) - logsigmoid(-b h) eps, written here
    # as the cross-entropy of sigmoid(b h) against the smoothed label 1 - eps
    pc, pr, rc, rr = logps(1)
    beta, eps = 0.3, 0.2
    loss, _ = dpo_loss(pc, pr, rc, rr, beta, label_smoothing=eps)
    p = torch.sigmoid(beta * ((pc - pr) - (rc - rr)))
    expected = -((1 - eps) * torch.log(p) + eps * torch.log(1 - p)).mean()
    assert torch.allclose(loss, expected, atol=1e-12)
    assert not torch.allclose(loss, dpo_loss(pc, pr, rc, rr, beta)[0])


def test_dpo_at_the_reference_is_log2_with_opposite_gradients():
    # policy == reference: h = 0, loss log 2; d loss / d log pi(chosen) = -beta/2 per pair (/ B for the mean) and the
    # rejected one's is the opposite: the gradient along the tied direction (both log-probs up alike) is zero
    pc, pr, _, _ = logps(2)
    pc, pr = pc.clone().requires_grad_(), pr.clone().requires_grad_()
    beta = 0.4
    loss, m = dpo_loss(pc, pr, pc.detach(), pr.detach(), beta)
    assert math.isclose(loss.item(), math.log(2), abs_tol=1e-12)
    loss.backward()
    B = pc.shape[0]
    assert torch.allclose(pc.grad, torch.full_like(pc, -beta / 2 / B))
    assert torch.allclose(pr.grad, -pc.grad)
    assert float(m["reward_acc"]) == 0.0 and float(m["margin"]) == 0.0


def test_a_tied_pair_at_the_reference_gives_the_model_no_gradient(tmp_path):
    # The pair's two replies are the same sequence and the policy is the reference: -beta/2 (grad log p_c -
    # grad log p_r) is exactly zero for every parameter; a real pair at the reference does get a gradient.
    model, _ = load_model(make_lm_checkpoint(tmp_path / "lm"))
    model.train()
    tok = load_tokenizer(tmp_path / "lm")
    template = chat_template_for(tok, None, "default")
    prompt = [{"role": "user", "content": "say cat"}]
    same = encode_reply(template, tok, prompt, "cat ok", 64)
    other = encode_reply(template, tok, prompt, "cat bad", 64)
    reference = copy.deepcopy(model).eval()

    def grads(second):
        model.zero_grad()
        batch = make_batch([EncodedItem(*same, *second)], [0], tok.pad_id)
        with torch.no_grad():
            ref, _ = sequence_logprobs(reference, batch.ids, batch.labels)
        policy, _ = sequence_logprobs(model, batch.ids, batch.labels)
        loss, _ = dpo_loss(policy[:1], policy[1:], ref[:1], ref[1:], beta=0.5)
        assert math.isclose(loss.item(), math.log(2), abs_tol=1e-6)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    tied, real = grads(same), grads(other)
    assert real.abs().max() > 1e-3
    assert tied.abs().max() < 1e-6 * float(real.abs().max())  # float32 rounding only


def test_ipo_loss_equals_the_formula():
    pc, pr, rc, rr = logps(3)
    beta = 0.25
    loss, m = ipo_loss(pc, pr, rc, rr, beta)
    h = (pc - pr) - (rc - rr)
    assert torch.allclose(loss, ((h - 1 / (2 * beta)) ** 2).mean(), atol=1e-12)
    assert torch.allclose(m["margin"], (beta * h).float().mean())


def test_kto_loss_equals_the_formula_with_a_detached_clamped_reference_point():
    pol, ref, pkl, rkl = logps(4)
    pkl = pkl.clone().requires_grad_()
    pol = pol.clone().requires_grad_()
    desirable = torch.tensor([True, False, True, True, False, False])
    beta, wd, wu = 0.2, 1.0, 1.5
    loss, m = kto_loss(pol, ref, desirable, pkl, rkl, beta, wd, wu)
    z0 = max(0.0, float((pkl - rkl).detach().mean()))
    r = pol.detach() - ref
    per = [wd * (1 - torch.sigmoid(beta * (r[i] - z0))) if desirable[i]
           else wu * (1 - torch.sigmoid(beta * (z0 - r[i]))) for i in range(6)]
    assert torch.allclose(loss.double(), torch.stack(per).mean(), atol=1e-6)
    assert math.isclose(float(m["kl"]), z0, abs_tol=1e-6)
    assert torch.allclose(m["chosen_reward"], (beta * r[desirable]).float().mean())
    assert torch.allclose(m["rejected_reward"], (beta * r[~desirable]).float().mean())
    loss.backward()
    assert pkl.grad is None or not pkl.grad.any()  # z0 is detached
    assert pol.grad.abs().sum() > 0
    # a negative KL estimate is clamped to 0
    _, m0 = kto_loss(pol, ref, desirable, rkl - 5.0, rkl, beta)
    assert float(m0["kl"]) == 0.0


# ---- data and log-probabilities -----------------------------------------------------------------------------

def test_reply_logprobs_score_only_the_reply_tokens(tmp_path):
    # The scored positions are the final reply and its end marker: not the prompt, not an earlier assistant turn;
    # their sum equals log p gathered by hand at those positions.
    model, _ = load_model(make_lm_checkpoint(tmp_path / "lm"))
    tok = load_tokenizer(tmp_path / "lm")
    template = chat_template_for(tok, None, "default")
    prompt = [{"role": "user", "content": "say moon"}, {"role": "assistant", "content": "earlier turn"},
              {"role": "user", "content": "again"}]
    ids, trained = encode_reply(template, tok, prompt, "moon ok", 64)
    end = len(ids)
    start = end - len("moon ok") - len("\n\n")  # the char tokenizer's default template ends a reply with a blank line
    assert tok.decode(ids[start:]) == "moon ok\n\n"
    assert [i for i, t in enumerate(trained) if t] == list(range(start, end))
    batch = make_batch([EncodedItem(ids, trained, ids, trained)], [0], tok.pad_id)
    total, count = sequence_logprobs(model, batch.ids[:1], batch.labels[:1])
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids])).float(), -1)[0]  # (T, V)
    manual = sum(float(logp[t - 1, ids[t]]) for t in range(start, end))
    assert int(count) == end - start
    assert math.isclose(float(total.detach()), manual, rel_tol=1e-5)


def test_truncation_keeps_the_reply_and_the_token_before_it(tmp_path):
    make_lm_checkpoint(tmp_path / "lm")
    tok = load_tokenizer(tmp_path / "lm")
    template = chat_template_for(tok, None, "default")
    prompt = [{"role": "user", "content": "a long prompt " * 5}]
    ids, trained = encode_reply(template, tok, prompt, "short", 20)
    assert len(ids) == 20 and trained[0] is False and sum(trained) == len("short") + 2
    ids, trained = encode_reply(template, tok, prompt, "a reply far longer than the limit", 10)
    assert len(ids) == 10 and trained[0] is False and all(trained[1:])


def test_identical_chosen_and_rejected_is_a_one_line_error_naming_the_line(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [PAIRS[0], {"prompt": "x", "chosen": "same", "rejected": "same"}])
    with pytest.raises(DataError) as err:
        read_preferences(path)
    assert f"{path}:2" in str(err.value) and "same text" in str(err.value) and "\n" not in str(err.value)
    path = write_jsonl(tmp_path / "q.jsonl", [PAIRS[0], PAIRS[1], {"prompt": "x", "chosen": "a"}])
    with pytest.raises(DataError, match=r"q\.jsonl:3: the line has no \"rejected\""):
        read_preferences(path)
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "x", "completion": "a", "label": True}])
    with pytest.raises(DataError, match=r"r\.jsonl:1: .*data\.loss: kto"):
        read_preferences(path)
    assert read_preferences(path, unpaired=True)[0].desirable is True


def test_the_dpo_task_refuses_bad_settings_in_one_line(tmp_path):
    data = {"path": str(write_jsonl(tmp_path / "p.jsonl", PAIRS))}
    with pytest.raises(ConfigError, match="needs train.init_from") as err:
        run("dpo", data, tmp_path / "out", init_from=None)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="data.label_smoothing"):
        run("dpo", {**data, "loss": "ipo", "label_smoothing": 0.1}, tmp_path / "out2", init_from=None)
    bad = write_jsonl(tmp_path / "bad.jsonl", [*PAIRS, {"prompt": "x", "chosen": "y", "rejected": "y"}])
    with pytest.raises(DataError, match=r"bad\.jsonl:9"):
        run("dpo", {"path": str(bad)}, tmp_path / "out3", init_from=make_lm_checkpoint(tmp_path / "lm"))


# ---- training ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss", ["dpo", "ipo", "kto"])
def test_a_tiny_run_raises_the_margin_and_the_reward_accuracy(tmp_path, loss, capsys):
    sft = make_lm_checkpoint(tmp_path / "sft")
    path = str(write_jsonl(tmp_path / "p.jsonl", PAIRS))
    trainer = run("dpo", {"path": path, "val_path": path, "loss": loss, "beta": 0.5}, tmp_path / "out", init_from=sft)
    before = trainer.task.evaluate(trainer.model)
    assert before["val_margin"] == pytest.approx(0.0, abs=1e-5)  # the policy starts at its reference
    assert before["val_loss"] == pytest.approx({"dpo": math.log(2), "ipo": 1.0, "kto": 0.5}[loss], abs=1e-5)
    after = trainer.fit()
    assert after["val_margin"] > before["val_margin"] + 0.3
    # (KTO's accuracy: examples on the right side of its KL reference point, a harder target)
    assert after["val_reward_acc"] >= (0.75 if loss == "kto" else 1.0) and after["val_loss"] < before["val_loss"]
    assert after["val_chosen_logp"] > before["val_chosen_logp"]
    if loss == "dpo":  # `tokenloom evaluate` of the checkpoint: the same metrics, against the recorded reference
        import json

        from tokenloom.cli.main import main

        assert main(["evaluate", str(tmp_path / "out"), "--json", "--device", "cpu", "--precision", "fp32"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["val_margin"] == pytest.approx(after["val_margin"], abs=1e-4)
        assert printed["val_reward_acc"] == after["val_reward_acc"]


def test_the_reference_stays_the_init_from_weights_on_resume(tmp_path):
    sft = make_lm_checkpoint(tmp_path / "sft")
    path = str(write_jsonl(tmp_path / "p.jsonl", PAIRS))
    data = {"path": path, "val_path": path, "beta": 0.5}
    first = run("dpo", data, tmp_path / "out", init_from=sft, stop_after_steps=10)
    first.fit()
    resumed = run("dpo", data, tmp_path / "out", init_from=sft, resume=True)
    assert resumed.step == 10
    metrics = resumed.task.evaluate(resumed.model)
    assert metrics["val_margin"] > 0.1  # measured against the sft weights, not the resumed policy (margin 0)
    reference, _ = load_model(sft)
    items = resumed.task.splits["val"]
    batch = make_batch(items, range(len(items)), resumed.task.pad_id)
    expected, _ = sequence_logprobs(reference, batch.ids, batch.labels)
    cached = resumed.task.cache["val"][0]
    assert torch.allclose(torch.cat([cached[:, 0], cached[:, 1]]), expected, atol=1e-5)
    assert resumed.task.reference_model is None  # freed once cached


def test_the_reference_cache_gives_the_uncached_losses(tmp_path):
    sft = make_lm_checkpoint(tmp_path / "sft")
    path = str(write_jsonl(tmp_path / "p.jsonl", PAIRS))
    losses = {}
    for cache in (True, False):
        trainer = run("dpo", {"path": path, "beta": 0.5, "reference_cache": cache}, tmp_path / f"out{cache}",
                      init_from=sft, steps=5, log_every=1)
        losses[cache] = trainer.fit()["train_loss"]
        assert (trainer.task.reference_model is None) == cache
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)


def test_kto_pairs_become_desirable_and_undesirable_examples_with_mismatched_partners(tmp_path):
    sft = make_lm_checkpoint(tmp_path / "sft")
    rows = [*PAIRS[:3], {"prompt": "say rock", "completion": "rock ok", "label": True}]
    trainer = run("dpo", {"path": str(write_jsonl(tmp_path / "p.jsonl", [*rows, PAIRS[4]])), "loss": "kto"},
                  tmp_path / "out", init_from=sft)
    items = trainer.task.splits["train"]
    assert [it.desirable for it in items] == [True, False] * 3 + [True]
    tok = trainer.tokenizer
    for it in items:  # the second sequence keeps the prompt, with the reply of another prompt's example
        own, other = tok.decode(it.first), tok.decode(it.second)
        head = own[:own.index("Assistant: ") + len("Assistant: ")]
        word = head.split("say ")[1].split("\n")[0]
        assert other.startswith(head) and not other[len(head):].startswith(word)


def test_data_reference_alone_starts_the_policy_from_it_and_must_share_the_tokenizer(tmp_path):
    sft = make_lm_checkpoint(tmp_path / "sft")
    path = str(write_jsonl(tmp_path / "p.jsonl", PAIRS))
    trainer = run("dpo", {"path": path, "reference": str(sft)}, tmp_path / "out", init_from=None)
    reference, _ = load_model(sft)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], tensor), name
    assert trainer.task.evaluate(trainer.model)["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    # a reference with another vocabulary than the policy's is refused in one line
    from tokenloom.checkpoint import write_checkpoint
    from tokenloom.data.tokenizers import Tokenizer

    model, config = load_model(sft)
    write_checkpoint(tmp_path / "other", model, config, Tokenizer.train_char("".join(sorted(set("xyz " * 3)))))
    with pytest.raises(ConfigError, match="another tokenizer"):
        run("dpo", {"path": path, "reference": str(tmp_path / "other")}, tmp_path / "out2", init_from=sft)
