import pytest
import torch

from tokenloom import GPT, GPTConfig
from tokenloom.errors import ConfigError, GenerationError
from tokenloom.models import GPT_PRESETS

POSITIONS = ["learned", "sinusoidal", "rope", "alibi", "t5", "none"]


def small(**kw):
    base = dict(vocab_size=40, num_layers=2, num_heads=4, embed_dim=32, max_seq_len=32)
    return GPT(GPTConfig(**{**base, **kw})).eval()


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_causality(position, placement):
    model = small(position=position, norm_placement=placement)
    x = torch.randint(0, 40, (2, 12))
    y = x.clone()
    y[:, 7:] = torch.randint(0, 40, (2, 5))
    a, b = model(x), model(y)
    assert torch.allclose(a[:, :7], b[:, :7], atol=1e-5)
    assert not torch.allclose(a[:, 7:], b[:, 7:], atol=1e-3)


@pytest.mark.parametrize("kw", [dict(mlp="swiglu", norm="rmsnorm", bias=False), dict(num_kv_heads=1),
                                dict(mlp="relu", tie_embeddings=False), dict(gradient_checkpointing=True),
                                dict(mlp="relu2", qk_norm=True, logit_softcap=3.0, position="rope")])
def test_variants_run_and_backprop(kw):
    model = small(**kw).train()
    x = torch.randint(0, 40, (2, 10))
    logits = model(x)
    assert logits.shape == (2, 10, 40)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_gradient_checkpointing_same_gradients():
    torch.manual_seed(1)
    a = small()
    b = small(gradient_checkpointing=True)
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 40, (2, 10))
    a.train()(x).square().mean().backward()
    b.train()(x).square().mean().backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), n


def test_tied_embeddings():
    model = small()
    assert model.lm_head.weight is model.tok_embed.weight


@pytest.mark.parametrize("name", list(GPT_PRESETS))
def test_presets_build(name):
    config = GPTConfig.from_name(name)
    assert config.head_dim * config.num_heads == config.embed_dim
    if name == "gpt2":
        n = sum(p.numel() for p in GPT(config).parameters())
        assert n == 124_439_808  # GPT-2 small, tied embeddings


def test_unknown_preset():
    with pytest.raises(ConfigError, match="did you mean 'gpt2'"):
        GPTConfig.from_name("gtp2")


def test_context_overflow_is_a_clear_error():
    model = small()
    with pytest.raises(GenerationError, match="exceeds the model's context of 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_overfits_one_batch():
    """The loss on one batch falls from ~ln 40 to under 0.05 (step ~110 here), within a cap of 500 steps."""
    torch.manual_seed(0)
    model = small(position="rope").train()
    x = torch.randint(0, 40, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(500):
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 40), x[:, 1:].reshape(-1))
        if step == 0:
            assert loss.item() > 3.0  # about ln 40 = 3.7 before training
        if loss.item() < 0.05:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05, f"loss {loss.item():.4f} after {step} steps"


def test_attention_dropout_separate_from_dropout():
    model = small(dropout=0.1, attention_dropout=0.0)
    block = model.blocks[0]
    assert block.attn.dropout == 0.0 and block.resid_dropout.p == 0.1
    assert small(dropout=0.1).blocks[0].attn.dropout == 0.1
    with pytest.raises(ConfigError, match="attention_dropout must be in"):
        small(attention_dropout=1.5)


def test_create_model_without_init_keeps_buffers_and_restores_init():
    from torch import nn

    from tokenloom.models.factory import create_model

    normal = nn.init.normal_
    config = GPTConfig(num_layers=1, num_heads=2, embed_dim=16, vocab_size=20, max_seq_len=8, position="rope")
    model = create_model("gpt", config, init=False)
    assert nn.init.normal_ is normal  # restored
    assert torch.equal(model.position.cos, GPT(config).position.cos)  # buffers are built, not skipped


@pytest.mark.parametrize("attention", ["sdpa", "performer"])
def test_bf16_logits_are_within_tolerance_of_fp32(attention):
    """bf16 inference weights and bf16 autocast both stay within 5% of the fp32 logits' spread (measured: 0.14-0.17
    against a standard deviation of ~7.3, i.e. ~2%) and agree on >= 95% of next-token argmaxes (measured: all),
    with the embedding scaled up so that the logits are far from uniform."""
    import copy

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, num_layers=2, num_heads=2, embed_dim=64, max_seq_len=32,
                          attention=attention)).eval()
    with torch.no_grad():
        model.tok_embed.weight.mul_(30)  # tied output layer: logits with a spread of ~7
        ids = torch.randint(0, 50, (4, 32))
        reference = model(ids)
        low = copy.deepcopy(model).to(torch.bfloat16)(ids).float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(ids).float()
    assert reference.std() > 5
    for logits in (low, autocast):
        assert (logits - reference).abs().max() < 0.05 * reference.std()
        assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.95


def test_relu2_mlp_is_relu_squared_between_the_two_layers():
    mlp = small(mlp="relu2").blocks[0].mlp
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        expected = mlp.fc_out(torch.relu(mlp.fc_in(x)) ** 2)
        torch.testing.assert_close(mlp(x), expected)
        torch.testing.assert_close(mlp.inference_function()(x), expected)


def test_logit_softcap_bounds_the_logits_and_equals_the_formula():
    torch.manual_seed(0)
    plain = small(tie_embeddings=False)
    capped = small(tie_embeddings=False, logit_softcap=0.05)
    capped.load_state_dict(plain.state_dict())  # the cap adds no parameters
    x = torch.randint(0, 40, (2, 10))
    with torch.no_grad():
        raw, logits = plain(x), capped(x)
        cache = capped.create_cache(2)
        stepped = torch.cat([capped(x[:, :4], cache=cache)] + [capped(x[:, t:t + 1], cache=cache)
                                                               for t in range(4, 10)], dim=1)
    assert logits.abs().max() < 0.05 < raw.abs().max()
    torch.testing.assert_close(logits, 0.05 * torch.tanh(raw / 0.05))
    torch.testing.assert_close(stepped, logits)  # cached (the plain step head) == uncached


def test_qk_norm_normalises_each_head_and_adds_only_the_norm_weights():
    plain, normed = small(norm="rmsnorm"), small(norm="rmsnorm", qk_norm=True)
    extra = sum(p.numel() for p in normed.parameters()) - sum(p.numel() for p in plain.parameters())
    assert extra == 2 * 2 * normed.config.head_dim  # q and k norms over head_dim, in each of 2 layers
    assert plain.blocks[0].attn.q_norm is None
    assert small(qk_norm=True).blocks[0].attn.q_norm.weight.shape == (8,)


@pytest.mark.parametrize("cap", [0, -1.0])
def test_a_bad_logit_softcap_is_a_config_error_naming_it(cap):
    with pytest.raises(ConfigError, match=f"logit_softcap.*{cap}"):
        GPTConfig(logit_softcap=cap)
