"""causal_check, head_diagnostics and attention_rollout on real captures and constructed heads."""

import torch

from tests.generation.helpers import left_pad
from tokenloom import GPT, GPTConfig
from tokenloom.viz import attention_rollout, capture_attention, causal_check, head_diagnostics


def gpt(position="learned"):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, num_layers=2, num_heads=4, embed_dim=32, max_seq_len=32,
                         position=position)).eval()


def captured(model, ids, mask=None):
    with torch.no_grad(), capture_attention(model) as maps:
        model(ids, attention_mask=mask)
    return maps


def test_causal_check_passes_on_gpt_with_padding_and_every_position_scheme():
    ids, mask = left_pad([torch.randint(0, 40, (10,)), torch.randint(0, 40, (4,))])
    for position in ("learned", "rope", "alibi", "t5"):
        maps = captured(gpt(position), ids, mask)
        for layer in maps.layers("self"):
            result = causal_check(maps.get("self", layer), layer, query_mask=mask)
            assert result.passed and result.max_mass == 0.0 and result.heads == []


def test_causal_check_fails_on_a_broken_mask(monkeypatch):
    import tokenloom.models.gpt as gpt_module

    model = gpt()
    monkeypatch.setattr(gpt_module, "plan_attention", lambda *args, **kwargs: (None, False, None))  # mask forgotten
    maps = captured(model, torch.randint(0, 40, (2, 8)))
    result = causal_check(maps.get("self", 0), 0)
    assert not result.passed and result.max_mass > 0.1 and result.heads == [0, 1, 2, 3]


def test_diagnostics_flag_a_uniform_and_a_collapsed_head():
    T = 12
    causal = torch.ones(T, T).tril()
    uniform = causal / causal.sum(-1, keepdim=True)  # every allowed key alike
    previous = torch.zeros(T, T)
    previous[0, 0] = 1.0
    previous[torch.arange(1, T), torch.arange(T - 1)] = 1.0  # one-hot on the previous token
    first = torch.zeros(T, T)
    first[:, 0] = 1.0  # one-hot on the first token (an attention sink)
    mixed = 0.5 * uniform + 0.5 * previous
    probs = torch.stack([uniform, previous, first, mixed])[None]  # (1, 4, T, T)
    stats = head_diagnostics(probs, layer=3, causal=True)
    assert [s.head for s in stats] == [0, 1, 2, 3] and all(s.layer == 3 for s in stats)
    assert stats[0].flags == ["uniform"] and abs(stats[0].normalized_entropy - 1.0) < 1e-6
    assert stats[1].flags == ["collapsed (previous token)"] and stats[1].previous_token == 1.0
    assert stats[2].flags == ["collapsed (first token)"] and stats[2].first_token == 1.0
    assert stats[3].flags == []
    assert 0.0 < stats[3].normalized_entropy < 0.9
    assert stats[0].as_dict()["flags"] == ["uniform"]


def test_diagnostics_skip_padding_rows_and_rows_with_one_key():
    ids, mask = left_pad([torch.randint(0, 40, (10,)), torch.randint(0, 40, (3,))])
    maps = captured(gpt(), ids, mask)
    stats = head_diagnostics(maps.get("self", 0), 0, query_mask=mask, key_mask=mask, causal=True)
    for s in stats:
        assert 0.0 <= s.normalized_entropy <= 1.0 and 0.0 < s.max_prob <= 1.0
        assert abs(s.previous_token + s.first_token) > 0  # real rows contributed


def test_rollout_rows_sum_to_one_and_identity_attention_rolls_out_to_identity():
    maps = [torch.softmax(torch.randn(2, 4, 5, 5), -1) for _ in range(3)]
    rollout = attention_rollout(maps)
    assert rollout.shape == (2, 5, 5)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, 5))
    eye = torch.eye(5).expand(2, 4, 5, 5)
    torch.testing.assert_close(attention_rollout([eye, eye]), torch.eye(5).expand(2, 5, 5))
    one = attention_rollout(maps[:1], residual=False)
    torch.testing.assert_close(one, maps[0].mean(1))
