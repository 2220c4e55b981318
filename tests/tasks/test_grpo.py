"""GRPO: per-group advantage normalisation, the k3 KL, the loss against its formula and its gradients (only the KL
term with tied rewards, zero at the reference), sampling from the current policy, the sequence-level KL, the
reference from train.init_from (on resume too), bad input, and a tiny run whose reward rises."""

import copy
import json
import math

import numpy as np
import pytest
import torch

from tokenloom.checkpoint import read_weights, write_checkpoint
from tokenloom.config import to_dict
from tokenloom.data.chat import DefaultChatTemplate
from tokenloom.data.tokenizers import Tokenizer
from tokenloom.errors import ConfigError, DataError
from tokenloom.models.gpt import GPT, GPTConfig
from tokenloom.tasks.grpo import GRPOBatch, group_advantages, grpo_loss
from tokenloom.tasks.policy import k3_kl, policy_kl, sample_completions, token_logprobs
from tokenloom.tasks.sequences import IGNORE
from tokenloom.training.config import load_run_config
from tokenloom.training.setup import setup_run

WORDS = ["cat", "dog", "bird", "fish", "cow", "pig", "hen", "fox", "owl", "bee", "ant", "elk"]
MODEL = {"family": "gpt", "num_layers": 2, "num_heads": 2, "embed_dim": 32, "max_seq_len": 48}
STARTS_WITH_A = [{"name": "regex", "options": {"pattern": "a.*", "flags": "s"}}]
# (an evaluation before the first checkpoint logs a line that fit() then replaces, with a warning)
pytestmark = pytest.mark.filterwarnings("ignore:.*of an earlier run:UserWarning")


def prompt_file(path, words=WORDS):
    path.write_text("".join(json.dumps({"prompt": f"say {w}", "answer": w}) + "\n" for w in words))
    return path


def grpo_recipe(tmp_path, data=None, train=None, model=None):
    data = {"path": str(prompt_file(tmp_path / "prompts.jsonl")), "rewards": STARTS_WITH_A, "group_size": 8,
            "max_new_tokens": 6, "prompts_per_step": 4, "val_fraction": 0.25, **(data or {})}
    train = {"max_steps": 30, "batch_size": 4, "lr": 1e-2, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0,
             "device": "cpu", "precision": "fp32", "log_every": 1, "seed": 0, "threads": 1, **(train or {})}
    return load_run_config({"task": "grpo", "model": model or MODEL, "data": data, "train": train})


# ---- advantages, KL, loss ---------------------------------------------------------------------------------------

def test_group_advantages_normalise_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0,  # two right, two wrong
                            2.0, 2.0, 2.0, 2.0,  # all equal: no signal
                            0.0, 1.0, 2.0, 3.0,
                            5.0, -1.0, 0.5, 0.5])
    adv = group_advantages(rewards, 4).view(4, 4)
    grouped = rewards.view(4, 4).numpy()
    for g in (0, 2, 3):
        expected = (grouped[g] - grouped[g].mean()) / (grouped[g].std(ddof=1) + 1e-4)  # TRL: Bessel's std + 1e-4
        np.testing.assert_allclose(adv[g].numpy(), expected, rtol=1e-6, atol=1e-6)
        assert abs(float(adv[g].mean())) < 1e-6
        assert float(adv[g].std()) == pytest.approx(1.0, abs=1e-3)
    assert torch.equal(adv[1], torch.zeros(4))  # a constant group: exactly zero
    # the groups are the consecutive rows: the same rewards grouped otherwise normalise otherwise
    assert not torch.allclose(group_advantages(rewards, 2), group_advantages(rewards, 4))


def test_k3_kl():
    logp = torch.log(torch.tensor([0.5, 0.2, 0.3]))
    assert torch.equal(k3_kl(logp, logp), torch.zeros(3))
    ref = torch.log(torch.tensor([0.25, 0.25, 0.5]))
    kl = k3_kl(logp, ref)
    assert (kl > 0).all()
    d = ref - logp
    torch.testing.assert_close(kl, torch.exp(d) - d - 1)
    # over the policy's own samples its mean is KL(p || q): for a categorical distribution, exactly
    p = logp.exp()
    assert float((p * kl).sum()) == pytest.approx(float((p * (logp - ref)).sum()), abs=1e-6)


def _loss_by_hand(logp, ref, mask, adv, beta, eps, old):
    rows = []
    for i in range(len(logp)):
        terms = []
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(ratio, 1 - eps), 1 + eps)
            d = ref[i][t] - logp[i][t]
            terms.append(-min(ratio * adv[i], clipped * adv[i]) + beta * (math.exp(d) - d - 1))
        rows.append(sum(terms) / len(terms))
    return sum(rows) / len(rows)


def test_loss_equals_the_formula():
    gen = torch.Generator().manual_seed(1)
    N, L = 6, 7
    logp = -torch.rand(N, L, generator=gen) * 3
    ref = -torch.rand(N, L, generator=gen) * 3
    old = logp + (torch.rand(N, L, generator=gen) - 0.5)  # ratios from ~0.6 to ~1.6: some clipped
    lengths = [7, 3, 1, 5, 6, 2]
    mask = torch.tensor([[t < n for t in range(L)] for n in lengths])
    adv = torch.randn(N, generator=gen)
    loss, metrics = grpo_loss(logp, ref, mask, adv, beta=0.04, epsilon=0.2, old_logp=old)
    expected = _loss_by_hand(logp.tolist(), ref.tolist(), mask.tolist(), adv.tolist(), 0.04, 0.2, old.tolist())
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert 0 < float(metrics["clip_ratio"]) < 1
    kl_rows = [(k3_kl(logp[i, :n], ref[i, :n])).mean() for i, n in enumerate(lengths)]
    assert float(metrics["kl"]) == pytest.approx(float(torch.stack(kl_rows).mean()), rel=1e-5)


def test_policy_gradient_without_kl_is_reinforce():
    """beta 0, old policy = the policy: d loss / d logp[i][t] = -A_i / (n_i * N) on completion tokens."""
    N, L = 4, 5
    logp = (-torch.rand(N, L)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]).bool()
    adv = torch.tensor([1.5, -0.5, 0.25, -1.25])
    loss, _ = grpo_loss(logp, torch.zeros(N, L), mask, adv, beta=0.0, epsilon=0.2)
    loss.backward()
    n = mask.sum(1, keepdim=True).float()
    torch.testing.assert_close(logp.grad, -(adv[:, None] / (n * N)) * mask)


def test_tied_rewards_leave_only_the_kl_term_which_is_zero_at_the_reference():
    N, L = 8, 4
    rewards = torch.full((N,), 0.7)
    adv = group_advantages(rewards, 4)
    assert torch.equal(adv, torch.zeros(N))
    mask = torch.ones(N, L, dtype=torch.bool)
    ref = -torch.rand(N, L)
    logp = (ref + 0.3 * torch.randn(N, L)).requires_grad_()
    loss, _ = grpo_loss(logp, ref, mask, adv, beta=0.1, epsilon=0.2)
    loss.backward()
    # only the KL term: beta * d k3 / d logp = beta * (1 - exp(ref - logp)), per row mean, batch mean
    torch.testing.assert_close(logp.grad, 0.1 * (1 - torch.exp(ref - logp.detach())) / (L * N))
    assert float(loss.detach()) == pytest.approx(float(0.1 * k3_kl(logp.detach(), ref).mean()), rel=1e-6)
    at_ref = ref.clone().requires_grad_()
    loss, _ = grpo_loss(at_ref, ref, mask, adv, beta=0.1, epsilon=0.2)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.count_nonzero(at_ref.grad) == 0


def test_token_logprobs():
    logits = torch.randn(2, 4, 9)
    labels = torch.tensor([[3, 1, IGNORE, IGNORE], [IGNORE, 8, 0, 2]])
    out = token_logprobs(logits, labels, temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(out, ref * (labels != IGNORE))
    limited = token_logprobs(logits, labels.clamp(max=5).masked_fill(labels == IGNORE, IGNORE), vocab_limit=6)
    ref = torch.log_softmax(logits[..., :6], -1).gather(-1, labels.clamp(0, 5)[..., None])[..., 0]
    torch.testing.assert_close(limited, ref * (labels != IGNORE))


# ---- the task, end to end ---------------------------------------------------------------------------------------

def test_model_gradient_with_tied_rewards_at_the_reference_is_zero(tmp_path):
    """Through the task: every completion scores the same (a length reward without limits), the policy is still its
    reference, so no parameter gets a gradient; a reward that separates completions gives one."""
    trainer = setup_run(grpo_recipe(tmp_path, {"rewards": [{"name": "length"}]}), tmp_path / "run",
                        show_progress=False)
    task, model = trainer.task, trainer.model
    batch = task.get_batch(trainer.generator)
    assert isinstance(batch, GRPOBatch) and batch.ids.shape[0] == 4 * 8
    assert torch.equal(batch.advantages, torch.zeros(32))
    model.train()
    loss, tokens = task.loss(model, batch)
    loss.backward()
    assert tokens == int((batch.labels != IGNORE).sum()) > 0
    assert abs(float(loss.detach())) < 1e-9
    # (zero up to rounding: the reference's eval-mode forward and the policy's training forward round alike only
    # nearly, and d k3 / d logp = 1 - exp(ref - logp))
    tied = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    model.zero_grad()
    task.rewards = type(task.rewards)(STARTS_WITH_A + [{"name": "length", "options": {"max": 3}}])
    batch = task.get_batch(trainer.generator)
    loss, _ = task.loss(model, batch)
    loss.backward()
    assert batch.advantages.abs().sum() > 0
    separated = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    assert tied < 1e-6 < 1e-3 < separated, (tied, separated)


def test_a_tiny_run_raises_the_reward(tmp_path):
    """From scratch, reward 1 for completions that start with 'a' (about 1 in 27 at first): 30 steps of 4 prompts x
    8 samples take the training reward from near 0 to most completions, and every greedy validation completion."""
    trainer = setup_run(grpo_recipe(tmp_path), tmp_path / "run", show_progress=False)
    before = trainer.evaluate()
    assert before["val_reward"] < 0.5 and before["val_kl"] == 0.0
    summary = trainer.fit()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "reward" in r]
    assert len(steps) == 30
    for key in ("reward", "reward_std", "kl", "completion_length", "zero_std_groups", "clip_ratio"):
        assert key in steps[0]
    first = np.mean([r["reward"] for r in steps[:5]])
    last = np.mean([r["reward"] for r in steps[-5:]])
    assert first < 0.25 and last > 0.6, (first, last)
    assert steps[-1]["kl"] > steps[0]["kl"] >= 0
    assert summary["val_reward"] == 1.0 and summary["val_satisfied"] == 1.0
    assert summary["val_kl"] > 0  # the policy moved away from its reference


def test_samples_follow_the_updated_policy(tmp_path):
    """After training steps (a fused AdamW, which bumps no version counter), a batched one-token decode step reads
    the new weights: its logits equal a full forward's (the decode path's prepared weights are refreshed)."""
    trainer = setup_run(grpo_recipe(tmp_path), tmp_path / "run", show_progress=False)
    model = trainer.model
    x = torch.tensor([trainer.task.prompt_ids["train"][0]] * 2)
    nxt = torch.tensor([[5], [7]])
    for _ in range(3):
        model.eval()
        with torch.no_grad():
            cache = model.create_cache(2, 40)
            model(x, cache=cache)
            step = model(nxt, cache=cache, positions=torch.full((2, 1), x.shape[1]))[:, -1]
            full = model(torch.cat([x, nxt], 1))[:, -1]
        torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)
        model.train()
        trainer.train_step()


def _tiny_lm_checkpoint(path, text):
    tokenizer = Tokenizer.train_char(text)
    torch.manual_seed(3)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, **{k: v for k, v in MODEL.items() if k != "family"})
    model = GPT(config)
    write_checkpoint(path, model, {"task": "lm", "model": {"family": "gpt", **to_dict(config)}, "tokenizer": {}},
                     tokenizer)
    return model


def test_reference_is_init_from_also_on_resume(tmp_path):
    text = "System: User: Assistant: \n" + " ".join(f"say {w}" for w in WORDS)
    start = _tiny_lm_checkpoint(tmp_path / "start", text)
    recipe = grpo_recipe(tmp_path, train={"init_from": str(tmp_path / "start"), "max_steps": 6,
                                          "stop_after_steps": 3, "checkpoint_every": 3})
    trainer = setup_run(recipe, tmp_path / "run", show_progress=False)
    for name, tensor in start.state_dict().items():
        assert torch.equal(trainer.task.reference.state_dict()[name], tensor)
        assert torch.equal(trainer.model.state_dict()[name], tensor)
    assert trainer.evaluate()["val_kl"] == 0.0  # the policy starts as its reference
    trainer.fit()
    position = trainer.task.state_dict()
    resumed = setup_run(recipe, tmp_path / "run", resume=True, show_progress=False)
    trained = read_weights(tmp_path / "run" / "checkpoint")
    assert any(not torch.equal(trained[k], v) for k, v in start.state_dict().items() if k in trained)
    for name, tensor in start.state_dict().items():  # the reference stays the starting weights
        assert torch.equal(resumed.task.reference.state_dict()[name], tensor)
    assert resumed.task.state_dict() == position == {"epoch": 1, "position": 3}  # 3 steps x 4 of 9 prompts


def _policy_and_perturbed(tmp_path, scale: float, seed: int):
    """(a tiny character LM, a copy with N(0, scale^2) added to every weight, their tokenizer)."""
    text = "System: User: Assistant: \nabcdefgh"
    policy = _tiny_lm_checkpoint(tmp_path / "a", text).eval()
    reference = copy.deepcopy(policy)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(scale * torch.randn_like(p))
    return policy, reference, Tokenizer.train_char(text)


def test_policy_kl(tmp_path):
    """0 for a policy against itself; for another model, within sampling error of the exact KL of one-token
    completions (their distributions enumerated)."""
    policy, reference, tokenizer = _policy_and_perturbed(tmp_path, 0.5, seed=5)
    template = DefaultChatTemplate(tokenizer)
    prompts = ["abc", "hg"]
    assert policy_kl(policy, copy.deepcopy(policy), tokenizer, prompts, template, 4, max_new_tokens=3) == 0.0
    details = {}
    estimate = policy_kl(policy, reference, tokenizer, prompts, template, 300, max_new_tokens=1, details=details)
    exact = []
    for prompt in prompts:
        ids = torch.tensor([template.encode_prompt(tokenizer, [{"role": "user", "content": prompt}])])
        with torch.no_grad():
            p, q = (torch.log_softmax(m(ids)[0, -1], -1) for m in (policy, reference))
        exact.append(float((p.exp() * (p - q)).sum()))
    assert details["samples"] == 600
    assert estimate == pytest.approx(np.mean(exact), abs=4 * details["kl_std"] / math.sqrt(600))
    assert estimate > 0


def test_sampled_completions_stop_at_the_end_marker():
    """A model whose every next-token distribution is the same (final norm zeroed, its bias fixed): the end marker
    ends the completion and stays in its ids, the reply text leaves it out; batched rows of different prompt lengths
    complete as they do alone."""
    tokenizer = Tokenizer.train_char("System: User: Assistant: \nabcxyz")
    config = GPTConfig(vocab_size=tokenizer.vocab_size, num_layers=1, num_heads=2, embed_dim=16, max_seq_len=32,
                       tie_embeddings=False)
    model = GPT(config).eval()
    v = torch.randn(16)
    template = DefaultChatTemplate(tokenizer)  # a char tokenizer: the stop string "\n\n"

    def favour(char):
        with torch.no_grad():
            model.final_norm.weight.zero_()
            model.final_norm.bias.copy_(v)
            model.lm_head.weight.normal_(0, 0.01)
            model.lm_head.weight[tokenizer.encode(char)[0]] = 5 * v

    prompts = [template.encode_prompt(tokenizer, [{"role": "user", "content": c}]) for c in ("a", "abcxyz")]
    favour("\n")
    out = sample_completions(model, tokenizer, template, prompts, max_new_tokens=5, temperature=0.0)
    nl = tokenizer.encode("\n")[0]
    assert out.completion_ids == [[nl, nl], [nl, nl]] and out.texts == ["", ""] and out.ended == [True, True]
    favour("x")
    out = sample_completions(model, tokenizer, template, prompts, max_new_tokens=4, temperature=0.0)
    assert out.texts == ["xxxx", "xxxx"] and out.ended == [False, False]
    alone = sample_completions(model, tokenizer, template, prompts[1:], max_new_tokens=4, temperature=0.0)
    assert alone.completion_ids[0] == out.completion_ids[1]
    ids, trained = out.rows()
    assert ids[1] == prompts[1] + out.completion_ids[1] and trained[1] == [False] * len(prompts[1]) + [True] * 4


# ---- bad input --------------------------------------------------------------------------------------------------

def test_bad_settings(tmp_path):
    with pytest.raises(ConfigError, match="data.group_size must be >= 2"):
        grpo_recipe(tmp_path, {"group_size": 1})
    with pytest.raises(ConfigError, match="data.rewards must list at least one reward"):
        grpo_recipe(tmp_path, {"rewards": []})
    with pytest.raises(ConfigError, match=r"data.rewards\[0\].name: unknown reward 'exakt' \(did you mean 'exact'"):
        grpo_recipe(tmp_path, {"rewards": [{"name": "exakt"}]})
    with pytest.raises(ConfigError, match=r"data.rewards\[0\].options.pattern: '\[' is not a valid regular"):
        grpo_recipe(tmp_path, {"rewards": [{"name": "regex", "options": {"pattern": "["}}]})


def test_bad_prompt_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "say cat", "answer": "cat"}\n{"question": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected a JSON object with a \"prompt\""):
        setup_run(grpo_recipe(tmp_path, {"path": str(bad)}), tmp_path / "run", show_progress=False)
    bad.write_text('{"prompt": [{"role": "robot", "content": "hi"}]}\n')
    with pytest.raises(DataError, match="bad.jsonl:1: messages\\[0\\] has role 'robot'"):
        setup_run(grpo_recipe(tmp_path, {"path": str(bad)}), tmp_path / "run", show_progress=False)
    bad.write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in WORDS))
    with pytest.raises(DataError, match=r"bad.jsonl:1: no 'answer' field, which data.rewards\[0\] \(exact\) reads"):
        setup_run(grpo_recipe(tmp_path, {"path": str(bad), "rewards": [{"name": "exact"}]}), tmp_path / "run",
                  show_progress=False)
    long = prompt_file(tmp_path / "long.jsonl", WORDS[:3] + ["x" * 40])
    with pytest.raises(DataError, match=r"long.jsonl:4: the prompt is \d+ tokens; with data.max_new_tokens=6 it "
                                        r"needs \d+ positions, more than model.max_seq_len=48"):
        setup_run(grpo_recipe(tmp_path, {"path": str(long), "val_fraction": 0.5}), tmp_path / "run",
                  show_progress=False)



def test_policy_kl_k3_is_never_negative_where_k1_can_be(tmp_path):
    """Two close models, one sample per prompt: the k1 estimate (the summed log-ratio) comes out below 0 for some
    seeds -- a negative "KL" -- while the k3 estimate (the default, GRPO's val_kl) is >= 0 for every seed, and both
    are reported in ``details``."""
    policy, reference, tokenizer = _policy_and_perturbed(tmp_path, 0.02, seed=7)
    template = DefaultChatTemplate(tokenizer)
    k1, k3 = [], []
    for seed in range(12):
        details = {}
        k3.append(policy_kl(policy, reference, tokenizer, ["abc"], template, 1, max_new_tokens=4, seed=seed,
                            details=details))
        assert details["kl_k3"] == pytest.approx(k3[-1]) and details["samples"] == 1
        k1.append(policy_kl(policy, reference, tokenizer, ["abc"], template, 1, max_new_tokens=4, seed=seed,
                            estimator="k1"))
        assert details["kl_k1"] == pytest.approx(k1[-1])
    assert min(k3) >= 0 and min(k1) < 0, (k1, k3)
    with pytest.raises(ValueError, match="estimator must be one of k3, k1"):
        policy_kl(policy, reference, tokenizer, ["abc"], template, 1, estimator="k2")
