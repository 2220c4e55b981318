"""The speedrun's model options for GPT, each off by default: model.value_embeddings and model.unet_skips
(tokenloom/nn/speedrun.py): what each adds, the formulas written out, cached == uncached through every step path,
padded batches, resuming a Muon run bit for bit, the checks and the exporters' refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from tests.generation.helpers import left_pad, reference_greedy
from tests.training.test_trainer import params, recipe, run

from tokenloom import GPT, GPTConfig
from tokenloom.checkpoint import load_model, write_checkpoint
from tokenloom.errors import ConfigError, GenerationError
from tokenloom.generation import GenerationConfig, generate
from tokenloom.generation.early_exit import check_early_exit
from tokenloom.interop import converter_for
from tokenloom.models.sizes import parameter_count
from tokenloom.nn.block import runs_plain
from tokenloom.nn.speedrun import value_embed_tables
from tokenloom.training.optim import MuonWithAdamW, hidden_matrices

BASE = dict(vocab_size=40, num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=32,
            tie_embeddings=False)
OPTIONS = {"value": dict(value_embeddings=2), "unet": dict(unet_skips=True),
           "both": dict(value_embeddings=3, unet_skips=True)}


def model_of(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**BASE, **overrides})).eval()


def randomise_scalars(model: GPT) -> None:
    """Lambdas and skip weights away from their initial values, so a formula that ignored them would show."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        if model.value_embeds is not None:
            model.value_embeds.lambdas.copy_(torch.rand(model.value_embeds.lambdas.shape, generator=gen) + 0.5)
        if model.skips is not None:
            model.skips.weights.copy_(torch.rand(model.skips.weights.shape, generator=gen) + 0.5)


# ---- what each switch adds -------------------------------------------------------------------------------------

def test_the_defaults_add_nothing():
    model = model_of()
    assert model.value_embeds is None and model.skips is None
    assert not any("value" in n or "skip" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("layers, k, expected", [(6, 2, [0, 1, None, None, 0, 1]), (3, 2, [0, 1, 1]),
                                                 (4, 4, [0, 1, 2, 3]), (5, 1, [0, None, None, None, 0])])
def test_table_i_feeds_layer_i_and_layer_l_minus_k_plus_i(layers, k, expected):
    assert value_embed_tables(layers, k) == expected


def test_value_embeddings_add_k_tables_and_a_lambda_per_fed_layer():
    model = model_of(value_embeddings=2)  # 4 layers: tables 0, 1 feed layers 0, 1 and 2, 3
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("value_embeds")}
    kv_dim = 2 * 8  # num_kv_heads * head_dim
    assert shapes == {"value_embeds.tables.0.weight": (40, kv_dim), "value_embeds.tables.1.weight": (40, kv_dim),
                      "value_embeds.lambdas": (4,)}
    assert torch.all(model.value_embeds.lambdas == 0.5)
    plain = model_of()
    assert model.num_params() - plain.num_params() == 2 * 40 * kv_dim + 4
    assert model.num_params(non_embedding=True) - plain.num_params(non_embedding=True) == 4  # tables are lookups
    assert parameter_count(model.config) - parameter_count(plain.config) == 2 * 40 * kv_dim


def test_unet_skips_add_one_weight_per_skip():
    for layers, half in ((4, 2), (5, 2), (2, 1)):
        model = model_of(num_layers=layers, unet_skips=True)
        assert tuple(model.skips.weights.shape) == (half,) and torch.all(model.skips.weights == 1.0)


def test_with_lambda_zero_value_embeddings_change_nothing_and_otherwise_change_the_output():
    plain, mixed = model_of(), model_of(seed=1, value_embeddings=2)
    missing, unexpected = mixed.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(missing) == ["value_embeds.lambdas", "value_embeds.tables.0.weight",
                               "value_embeds.tables.1.weight"] and not unexpected
    x = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        reference, mixed_logits = plain(x), mixed(x)
        mixed.value_embeds.lambdas.zero_()
        torch.testing.assert_close(mixed(x), reference, rtol=0, atol=1e-6)
    assert (mixed_logits - reference).abs().max() > 1e-3


def test_with_skip_weights_zero_the_unet_model_is_the_plain_stack():
    plain, skipped = model_of(), model_of(seed=1, unet_skips=True)
    skipped.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        reference, with_skips = plain(x), skipped(x)
        skipped.skips.weights.zero_()
        torch.testing.assert_close(skipped(x), reference, rtol=0, atol=1e-6)
    assert (with_skips - reference).abs().max() > 1e-3


def test_the_first_layers_cached_values_are_v_plus_lambda_times_the_table_row():
    model = model_of(value_embeddings=1, position="learned")  # table 0 feeds layers 0 and 3
    randomise_scalars(model)
    x = torch.randint(0, 40, (2, 7))
    cache = model.create_cache(2, 16)
    with torch.no_grad():
        model(x, cache=cache)
        block = model.blocks[0]
        h = block.norm1(model.tok_embed(x) + model.position.weight.weight[:7])  # (B, T, C), pre-norm
        v = F.linear(h, block.attn.qkv_proj.weight, block.attn.qkv_proj.bias)[..., 32 + 16:]  # (B, T, Hkv D)
        expected = v + model.value_embeds.lambdas[0] * model.value_embeds.tables[0].weight[x]
        stored = cache.layer(0)[1][:, :, :7]  # (B, Hkv, T, D)
    torch.testing.assert_close(stored.transpose(1, 2).reshape(2, 7, 16), expected, rtol=1e-5, atol=1e-6)


def test_the_unet_loop_is_the_formula_written_out():
    model = model_of(num_layers=5, unet_skips=True)
    randomise_scalars(model)
    x = torch.randint(0, 40, (2, 9))
    w = model.skips.weights
    with torch.no_grad():
        h, contexts = model.layer_inputs(x, None, None, None)
        run_layer = [lambda h, i=i: model.blocks[i](h, contexts[i])[0] for i in range(5)]
        out0 = run_layer[0](h)
        out1 = run_layer[1](out0)
        out2 = run_layer[2](out1 + w[0] * out1)  # layer L//2 + 0 gets the output of layer L//2 - 1 = 1
        out3 = run_layer[3](out2 + w[1] * out0)  # layer L//2 + 1 gets the output of layer 0
        out4 = run_layer[4](out3)  # an odd L's last layer gets no skip
        torch.testing.assert_close(model.forward_features(x)[0], model.final_norm(out4))


# ---- cached == uncached, padded == one by one ------------------------------------------------------------------

def decode_in_pieces(model: GPT, x: torch.Tensor) -> tuple[torch.Tensor, object]:
    """A prefill of 4, three one-token steps, a call of 3 positions (the step functions over B * 3 rows), then
    one-token steps to the end."""
    cache = model.create_cache(x.shape[0], 24)
    pieces = [model(x[:, :4], cache=cache)]
    pieces += [model(x[:, t:t + 1], cache=cache) for t in range(4, 7)]
    pieces.append(model(x[:, 7:10], cache=cache))
    pieces += [model(x[:, t:t + 1], cache=cache) for t in range(10, x.shape[1])]
    return torch.cat(pieces, dim=1), cache


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "modules"])
@pytest.mark.parametrize("position", ["rope", "learned"])
@pytest.mark.parametrize("options", OPTIONS)
def test_cached_decoding_equals_the_uncached_forward(options, position, hooked):
    model = model_of(position=position, **OPTIONS[options])
    randomise_scalars(model)
    x = torch.randint(0, 40, (3, 14), generator=torch.Generator().manual_seed(2))
    handle = model.blocks[2].attn.register_forward_hook(lambda *a: None) if hooked else None
    with torch.no_grad():
        full = model(x)
        stepped, cache = decode_in_pieces(model, x)
    if handle is not None:
        handle.remove()
    torch.testing.assert_close(stepped, full, rtol=1e-5, atol=1e-5)
    assert runs_plain(cache) is (not hooked)  # the one-token step functions ran (or, hooked, the modules)


@pytest.mark.parametrize("options", OPTIONS)
def test_a_left_padded_batch_generates_what_each_row_does_alone(options):
    model = model_of(position="rope", **OPTIONS[options])
    randomise_scalars(model)
    rows = [torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 3, 6)]
    ids, mask = left_pad(rows, pad=7)
    config = GenerationConfig(max_new_tokens=8, do_sample=False)
    out = generate(model, ids, config, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = generate(model, row[None], config)[0]
        assert torch.equal(out[i, 9:], alone[len(row):]), i
        assert torch.equal(alone, reference_greedy(model, row, 8)), i


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    x = torch.randint(0, 40, (2, 10))
    grads = []
    for checkpointing in (False, True):
        model = model_of(gradient_checkpointing=checkpointing, **OPTIONS["both"]).train()
        model(x).logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0]["skips.weights"].abs().sum() > 0 and grads[0]["value_embeds.lambdas"].abs().sum() > 0
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


# ---- training: Muon leaves the new parameters to AdamW; a resumed run is exact ---------------------------------

def test_muon_takes_neither_the_value_tables_nor_the_scalars():
    model = model_of(**OPTIONS["both"])
    in_muon = {id(p) for p in hidden_matrices(model)}
    for name, p in model.named_parameters():
        if name.startswith(("value_embeds", "skips")):
            assert id(p) not in in_muon, name
    assert len(in_muon) == 4 * 4  # qkv, out, fc_in, fc_out in each of 4 blocks


def test_a_muon_run_with_both_options_resumes_bit_for_bit(tmp_path):
    cfg = recipe(tmp_path, optimizer="muon")
    cfg["model"].update(num_layers=3, value_embeddings=1, unet_skips=True)
    full, _ = run(cfg, tmp_path / "full")
    _, first = run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=4"])
    assert first["step"] == 4
    resumed, _ = run(cfg, tmp_path / "split", resume=True)
    assert resumed.step == 8 and isinstance(resumed.optimizer, MuonWithAdamW)
    a, b = params(full.model), params(resumed.model)
    assert "value_embeds.lambdas" in a and "skips.weights" in a
    assert not torch.equal(a["skips.weights"], torch.ones(1))  # trained
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_checkpoint_without_the_fields_loads_with_the_defaults(tmp_path):
    model = model_of()
    fields = {k: v for k, v in BASE.items()}
    write_checkpoint(tmp_path / "ckpt", model, {"model": {"family": "gpt", **fields}})
    loaded, _ = load_model(tmp_path / "ckpt")
    assert loaded.config.value_embeddings == 0 and loaded.config.unet_skips is False
    x = torch.randint(0, 40, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


# ---- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [-1, 5, True, 1.5])
def test_a_bad_value_embeddings_is_a_one_line_config_error_naming_it(value):
    with pytest.raises(ConfigError, match=rf"value_embeddings must be an integer in 0..num_layers=4, got {value}"):
        GPTConfig(**{**BASE, "value_embeddings": value})


def test_unet_skips_need_two_layers():
    with pytest.raises(ConfigError, match="unet_skips=True needs num_layers >= 2, got 1"):
        GPTConfig(**{**BASE, "num_layers": 1, "unet_skips": True})


@pytest.mark.parametrize("base", ["gpt2", "llama"])
@pytest.mark.parametrize("options, named", [(dict(value_embeddings=2), "value_embeddings=2"),
                                            (dict(unet_skips=True), "unet_skips=True")])
def test_every_exporter_refuses_the_options_in_one_line(base, options, named):
    plain = dict(vocab_size=40, num_layers=4, num_heads=4, embed_dim=32, max_seq_len=32)
    if base == "llama":
        plain.update(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)
    else:
        plain.update(mlp="gelu_tanh")
    config = dataclasses.replace(GPTConfig(**plain), **options)
    converter_for("gpt", GPTConfig(**plain))  # the plain config exports
    with pytest.raises(ConfigError) as err:
        converter_for("gpt", config)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_early_exit_refuses_unet_skips_in_one_line():
    check_early_exit(model_of(**OPTIONS["value"]))  # value embeddings ride in the layer contexts
    with pytest.raises(GenerationError, match=r"unet_skips=True") as err:
        check_early_exit(model_of(**OPTIONS["unet"]))
    assert "\n" not in str(err.value)
