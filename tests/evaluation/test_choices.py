"""Multiple-choice scoring by continuation log-likelihood (tokenloom.evaluation.choices): lm-eval's pairing of
context and continuation, sums equal to a hand-rolled per-token loop, is_greedy, the acc / acc_norm predictions, and a
memorised continuation winning."""

import math

import pytest
import torch
from torch import nn

from tests.generation.helpers import small_model
from tokenloom import GPT, GPTConfig
from tokenloom.data.tokenizers import Tokenizer
from tokenloom.errors import DataError
from tokenloom.evaluation import choice_accuracy, score_choices
from tokenloom.evaluation.choices import continuation_scores, encode_pair

TEXT = "the cat sat on the mat. a dog ran to the log! \n"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train_char(TEXT)


def test_encode_pair_moves_the_contexts_trailing_whitespace_to_the_continuation(tokenizer):
    ctx, cont = encode_pair(tokenizer, "the cat \n", "sat")
    assert ctx == tokenizer.encode("the cat")
    assert cont == tokenizer.encode(" \nsat")
    ctx, cont = encode_pair(tokenizer, "the ca", "t sat")
    assert (ctx, cont) == (tokenizer.encode("the ca"), tokenizer.encode("t sat"))
    with pytest.raises(DataError, match="empty context"):
        encode_pair(tokenizer, "", "cat")


def hand_rolled(model, context_ids, continuation_ids, window):
    """Each continuation token scored by its own forward pass over the (left-truncated) ids before it."""
    ids = (context_ids + continuation_ids)[-window:]
    start = len(ids) - len(continuation_ids)
    total, greedy = 0.0, True
    with torch.no_grad():
        for j in range(start, len(ids)):
            logp = torch.log_softmax(model(torch.tensor([ids[:j]]))[0, -1].float(), -1)
            total += logp[ids[j]].item()
            greedy &= bool(logp[ids[j]] == logp.max())
    return total, greedy


@pytest.mark.parametrize("max_length", [None, 12])  # 12: the context is left-truncated to 11 - len(continuation)
def test_sums_equal_a_per_token_loop(tokenizer, max_length):
    model = small_model(vocab_size=tokenizer.vocab_size, seed=3)
    items = [{"context": "the cat sat on ", "choices": ["the mat", "a dog", "the log!"], "label": 0},
             {"context": "a dog ran to\n", "choices": ["the log", " the mat"], "label": 1}]
    results = score_choices(model, tokenizer, items, max_length=max_length)
    window = (max_length or model.config.max_seq_len) - 1
    for item, result in zip(items, results, strict=True):
        for k, choice in enumerate(item["choices"]):
            ctx, cont = encode_pair(tokenizer, item["context"], choice)
            expected, greedy = hand_rolled(model, ctx, cont, window)
            assert result["loglikelihoods"][k] == pytest.approx(expected, abs=1e-5)
            assert result["is_greedy"][k] == greedy
            assert result["lengths"][k] == len(cont)


def test_is_greedy_for_the_models_own_greedy_continuation(tokenizer):
    model = small_model(vocab_size=tokenizer.vocab_size, seed=5)
    ids = tokenizer.encode("the cat")
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    greedy = tokenizer.decode(ids[7:])
    other = "".join("a" if c != "a" else "t" for c in greedy)
    [(_, is_greedy, values), (_, not_greedy, _)] = continuation_scores(
        model, [encode_pair(tokenizer, "the cat", c) for c in (greedy, other)])
    assert is_greedy and not not_greedy and len(values) == 6


class Uniform(nn.Module):
    """Equal logits everywhere: every token has log-probability -log V."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.config = vocab, GPTConfig(vocab_size=vocab, max_seq_len=64)
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, ids):
        return torch.zeros(*ids.shape, self.vocab) + 0 * self.dummy


def test_acc_takes_the_largest_sum_and_acc_norm_the_largest_per_character(tokenizer):
    # uniform: sum = -len * log V, so acc picks the shortest choice; per character every choice ties and the first
    # wins (numpy.argmax); ties are greedy (lm-eval: token_logprob == max(top_logprobs))
    [result] = score_choices(Uniform(tokenizer.vocab_size), tokenizer,
                             [{"context": "the", "choices": [" cat sat", " cat", " dog ran"], "label": 1}])
    v = math.log(tokenizer.vocab_size)
    assert result["loglikelihoods"] == pytest.approx([-8 * v, -4 * v, -8 * v])
    assert (result["pred"], result["pred_norm"], result["pred_bytes"]) == (1, 0, 0)
    assert (result["acc"], result["acc_norm"]) == (1.0, 0.0)
    assert result["is_greedy"] == [True, True, True]
    assert choice_accuracy([result, {**result, "acc": 0.0}]) == {"acc": 50.0, "acc_norm": 0.0, "acc_bytes": 0.0,
                                                                 "count": 2}


def test_bad_items_are_refused(tokenizer):
    model = Uniform(tokenizer.vocab_size)
    with pytest.raises(DataError, match="label"):
        score_choices(model, tokenizer, [{"context": "the", "choices": [" cat"], "label": 1}])
    with pytest.raises(DataError, match="no context"):
        score_choices(model, tokenizer, [{"context": "the", "choices": [" cat sat on"], "label": 0}], max_length=8)


def test_a_memorised_continuation_wins(tokenizer):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, num_layers=2, num_heads=2, embed_dim=32, max_seq_len=48))
    data = torch.tensor(tokenizer.encode(TEXT * 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for step in range(300):
        starts = torch.randint(0, len(data) - 33, (16,), generator=torch.Generator().manual_seed(step))
        batch = torch.stack([data[s:s + 33] for s in starts.tolist()])
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    items = [{"context": "the cat sat on the ", "choices": ["log! \n", "mat. a ", "cat sat", "dog ran"], "label": 1},
             {"context": "a dog ran to the", "choices": [" mat. a", " cat sa", " log! \n", " dog ra"], "label": 2}]
    results = score_choices(model, tokenizer, items)
    assert model.training  # left as it was
    assert [r["pred"] for r in results] == [1, 2] and [r["pred_norm"] for r in results] == [1, 2]
    assert all(r["is_greedy"][r["label"]] for r in results)
    assert choice_accuracy(results)["acc"] == 100.0
