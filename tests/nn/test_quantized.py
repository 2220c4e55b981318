"""Weight-only quantisation: the storage's error bound, every kernel that runs here against F.linear on the dequantised
weights, a quantised GPT decoding through the fast paths like the float model holding the dequantised weights, the
checkpoint round trip, and the one-line refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tokenloom import GPT, GenerationConfig, GPTConfig, generate
from tokenloom.checkpoint import (
    load_model,
    quantize_checkpoint,
    refuse_quantized,
    stored_quantization,
    write_checkpoint,
)
from tokenloom.errors import CheckpointError, ConfigError, GenerationError, TrainingError
from tokenloom.models.factory import model_config_to_dict
from tokenloom.nn.block import runs_plain
from tokenloom.nn.fused import bind_linear, decode_linear
from tokenloom.nn.int_kernels import (
    KERNELS,
    QuantizedWeights,
    dequantize,
    kernel_timings,
    pack_int4,
    quantize_weight,
    unpack_int4,
)
from tokenloom.nn.quantized import (
    KernelChoice,
    QuantizationConfig,
    QuantizedEmbedding,
    QuantizedLinear,
    fitting_group_size,
    is_quantized,
    quantization_of,
    quantize_model,
    select_kernels,
)

KERNEL_CASES = [(bits, k.name) for bits in (8, 4) for k in KERNELS[bits]]
GROUP = 32


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    config = dict(vocab_size=48, num_layers=2, num_heads=2, embed_dim=32, max_seq_len=32)
    return GPT(GPTConfig(**{**config, **overrides})).eval()


def dequantized_copy(float_model: nn.Module, quantized: nn.Module) -> nn.Module:
    """``float_model`` holding the weights ``quantized`` multiplies by (the tie of head and embedding kept where
    neither was quantised apart)."""
    model = copy.deepcopy(float_model)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
                target = model.get_submodule(name)
                target.weight = nn.Parameter(module.dequantized())  # a head of its own: the tie is broken
    return model.eval()


def use_kernel(model: nn.Module, name: str) -> None:
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.use_kernels(name, name)


def skip_unless_runs(bits: int, name: str, layer: QuantizedLinear, dtype: torch.dtype = torch.float32) -> None:
    kernel = next(k for k in KERNELS[bits] if k.name == name)
    if not kernel.runs(layer.weights, dtype):
        pytest.skip(f"int{bits} kernel {name} does not run here (op missing, device or shape)")


# --- storage ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
def test_quantisation_error_is_at_most_half_a_step(bits):
    w = torch.randn(48, 128) * torch.linspace(0.1, 3, 48)[:, None]
    stored = quantize_weight(w, bits, GROUP)
    step = stored.scales[:, None] if bits == 8 else stored.scales.repeat_interleave(GROUP, dim=1)
    error = (w - dequantize(stored)).abs()
    assert (error <= step / 2 * (1 + 1e-5) + 1e-6).all()
    assert stored.qweight.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert stored.qweight.shape == (48, 128 if bits == 8 else 64)


def test_int4_packing_is_portable_and_round_trips():
    q = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    packed = pack_int4(q)
    assert torch.equal(packed[:, 0], q[:, 0] | (q[:, 4] << 4))  # column j low, column j + in / 2 high
    assert torch.equal(unpack_int4(packed), q)


def test_zero_rows_and_constant_groups_quantise_exactly():
    w = torch.zeros(16, 64)
    w[1] = 0.5
    for bits in (8, 4):
        assert torch.equal(dequantize(quantize_weight(w, bits, GROUP)), w)


# --- kernels ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,name", KERNEL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_equals_linear_on_the_dequantised_weight(bits, name, dtype):
    linear = nn.Linear(64, 48)
    layer = QuantizedLinear.from_linear(linear, bits, GROUP).to(dtype)
    skip_unless_runs(bits, name, layer, dtype)
    layer.use_kernels(name, name)
    assert layer.kernels == (name, name)
    weight = layer.dequantized(torch.float32)
    for shape in ((1, 64), (5, 64), (2, 3, 64)):
        x = torch.randn(shape).to(dtype)
        expected = F.linear(x.float(), weight, layer.bias.float())
        limit = (1e-5 if dtype == torch.float32 else 3e-2) * expected.abs().max()
        for rows in (1, None):  # the decode kernel and the sequence kernel, bound as the fast paths bind them
            out = bind_linear(layer, rows)(x)
            assert out.shape == expected.shape and out.dtype == dtype
            assert (out.float() - expected).abs().max() <= limit
        assert (layer(x).float() - expected).abs().max() <= limit


def test_a_kernel_that_cannot_compute_a_layer_leaves_it_dequantising():
    layer = QuantizedLinear.from_linear(nn.Linear(64, 40), 4, GROUP)  # 40 output rows: not a multiple of 16
    assert layer.use_kernels("_weight_int4pack_mm_for_cpu", "dequantize") == ("dequantize", "dequantize")


def test_kernel_timings_measure_the_fallback_and_mark_what_cannot_run():
    times = kernel_timings(4, torch.float32, 1, 64, 40, GROUP, repeats=3)
    assert set(times) == {k.name for k in KERNELS[4]}
    assert 0 < times["dequantize"] < float("inf")
    assert times["_weight_int4pack_mm_for_cpu"] == float("inf")  # out 40 is not a multiple of 16


def test_select_kernels_takes_the_fastest_and_describes_it():
    model = quantize_model(tiny_gpt(), QuantizationConfig(bits=8))
    measured = []

    def timings(bits, dtype, rows, in_features, out_features, group_size):
        measured.append((bits, rows, in_features, out_features))
        return {"dequantize": 2e-3, "_weight_int8pack_mm": 1e-3 if rows == 1 else 5e-3}

    (choice,) = select_kernels(model, timings=timings)
    assert measured == [(8, 1, 32, 128), (8, 16, 32, 128)]  # the largest layer: the MLP's 32 -> 128
    assert (choice.decode_kernel, choice.sequence_kernel) == ("_weight_int8pack_mm", "dequantize")
    layer = model.blocks[0].mlp.fc_in
    if KERNELS[8][1].runs(layer.weights, torch.float32):
        assert layer.kernels == ("_weight_int8pack_mm", "dequantize")
    assert choice.describe() == ("int8 weights: kernel _weight_int8pack_mm (1.00 ms vs dequantize 2.00 ms at 1 x 32 "
                                 "-> 128; dequantize at 16 rows)")
    gone = KernelChoice(4, torch.float32, 1, 32, 128, {"dequantize": 1e-3, "_weight_int4pack_mm_for_cpu": float("inf")})
    assert "_weight_int4pack_mm_for_cpu does not run here" in gone.describe()


def test_bind_linear_keeps_the_float_path_and_names_an_unknown_layer():
    linear = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    assert torch.equal(bind_linear(linear, 3)(x), decode_linear(linear.weight, linear.bias, 3)(x))
    with pytest.raises(TypeError, match="Conv1d is not a linear layer"):
        bind_linear(nn.Conv1d(1, 1, 1))


def test_quantized_embedding_dequantises_the_rows_looked_up():
    embedding = nn.Embedding(20, 16)
    quantized = QuantizedEmbedding.from_embedding(embedding)
    ids = torch.tensor([[0, 5, 19], [3, 3, 1]])
    assert torch.allclose(quantized(ids), F.embedding(ids, quantized.dequantized()), atol=1e-6)
    assert (quantized(ids) - embedding(ids)).abs().max() <= quantized.scales.max() / 2 + 1e-6


# --- a quantised model -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,name", KERNEL_CASES)
@pytest.mark.parametrize("head", [False, True])
def test_quantised_gpt_decodes_like_the_float_model_on_its_dequantised_weights(bits, name, head):
    float_model = tiny_gpt()
    model = quantize_model(copy.deepcopy(float_model),
                           QuantizationConfig(bits=bits, group_size=GROUP, head=head, embedding=head))
    skip_unless_runs(bits, name, model.blocks[0].mlp.fc_in)
    use_kernel(model, name)
    reference = dequantized_copy(float_model, model)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(model(ids), reference(ids), atol=1e-4, rtol=1e-4)  # whole sequences (module path)
    config = GenerationConfig(max_new_tokens=12, do_sample=False)
    assert torch.equal(generate(model, ids, config), generate(reference, ids, config))
    cache = model.create_cache(1, 16)
    with torch.no_grad():
        model(ids, cache=cache)
        step = model(torch.tensor([[6]]), cache=cache)  # one token through the bound step functions
        full = reference(torch.cat([ids, torch.tensor([[6]])], dim=1))[:, -1:]
    assert runs_plain(cache) is True
    assert torch.allclose(step, full, atol=1e-4, rtol=1e-4)


def test_which_layers_are_quantised():
    model = quantize_model(tiny_gpt(), QuantizationConfig(bits=8))
    names = [name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert names == [f"blocks.{i}.{layer}" for i in range(2)
                     for layer in ("attn.qkv_proj", "attn.out_proj", "mlp.fc_in", "mlp.fc_out")]
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.tok_embed, nn.Embedding)
    assert model.lm_head.weight is model.tok_embed.weight  # blocks only: the tie stays
    assert quantization_of(model) == QuantizationConfig(bits=8)
    both = quantize_model(tiny_gpt(), QuantizationConfig(bits=4, group_size=GROUP, head=True))
    assert isinstance(both.lm_head, QuantizedLinear) and isinstance(both.tok_embed, nn.Embedding)  # tie broken
    assert quantization_of(tiny_gpt()) is None and is_quantized(both)


def test_a_quantised_model_evaluates_but_refuses_training_in_one_line():
    model = quantize_model(tiny_gpt(), QuantizationConfig(bits=8))
    model.eval()
    with pytest.raises(TrainingError) as err:
        model.train()
    assert "cannot be trained" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("make,message", [
    (lambda: QuantizationConfig(bits=3), "quantization.bits must be 4 or 8, got 3"),
    (lambda: QuantizationConfig(bits=4, group_size=100), "quantization.group_size must be one of 32, 64, 128, 256"),
    (lambda: quantize_model(tiny_gpt(), QuantizationConfig(bits=4, group_size=64)),
     "group_size=64 does not divide the input width 32 of blocks.0.attn.qkv_proj"),
    (lambda: quantize_model(quantize_model(tiny_gpt(), QuantizationConfig()), QuantizationConfig()),
     "already quantised"),
])
def test_bad_quantisation_is_a_one_line_config_error(make, message):
    with pytest.raises(ConfigError) as err:
        make()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_failed_quantisation_replaces_nothing():
    model = tiny_gpt()
    with pytest.raises(ConfigError):
        quantize_model(model, QuantizationConfig(bits=4, group_size=64))
    assert not is_quantized(model)
    assert fitting_group_size(model) == 32


def test_early_exit_refuses_a_quantised_model():
    from tokenloom.generation.early_exit import check_early_exit

    with pytest.raises(GenerationError, match="float models only"):
        check_early_exit(quantize_model(tiny_gpt(), QuantizationConfig()))


# --- checkpoints -----------------------------------------------------------------------------------------------------

def save(model: GPT, path, quantization: QuantizationConfig | None = None):
    config = {"model": model_config_to_dict("gpt", model.config)}
    if quantization is not None:
        config["quantization"] = quantization.as_dict()
    return write_checkpoint(path, model, config)


@pytest.mark.parametrize("quantization", [QuantizationConfig(bits=8, head=True, embedding=True),
                                          QuantizationConfig(bits=4, group_size=GROUP)])
def test_a_quantised_checkpoint_round_trips_bitwise(tmp_path, quantization):
    model = quantize_model(tiny_gpt(), quantization)
    save(model, tmp_path / "q", quantization)
    loaded, config = load_model(tmp_path / "q")
    assert stored_quantization(config) == quantization
    expected = model.state_dict()
    state = loaded.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    save(loaded, tmp_path / "again", quantization)
    stored = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("q", "again")]
    assert stored[0] == stored[1]


def test_quantize_checkpoint_stores_the_quantised_layers_of_the_float_one(tmp_path):
    float_model = tiny_gpt()
    save(float_model, tmp_path / "float")
    _, before, after = quantize_checkpoint(tmp_path / "float", tmp_path / "q", QuantizationConfig(bits=8))
    assert after < before
    loaded, _ = load_model(tmp_path / "q")
    fresh = quantize_model(load_model(tmp_path / "float")[0], QuantizationConfig(bits=8))
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(CheckpointError, match="already quantised"):
        quantize_checkpoint(tmp_path / "q", tmp_path / "qq", QuantizationConfig(bits=4))
    with pytest.raises(CheckpointError, match="not empty"):
        quantize_checkpoint(tmp_path / "float", tmp_path / "q", QuantizationConfig(bits=8))
    with pytest.raises(TrainingError, match="needs float weights") as err:
        refuse_quantized(tmp_path / "q", "train.init_from (fine-tuning)")
    assert "\n" not in str(err.value)
    refuse_quantized(tmp_path / "float", "resuming")  # a float checkpoint passes


def test_a_corrupt_quantization_section_is_a_checkpoint_error(tmp_path):
    save(quantize_model(tiny_gpt(), QuantizationConfig()), tmp_path / "q", QuantizationConfig())
    text = (tmp_path / "q" / "config.yaml").read_text().replace("bits: 8", "bits: 5")
    (tmp_path / "q" / "config.yaml").write_text(text)
    (tmp_path / "q" / "checksums.json").unlink()
    with pytest.raises(CheckpointError, match="quantization.bits must be 4 or 8, got 5"):
        load_model(tmp_path / "q")


def test_quantized_weights_know_their_shape():
    stored = quantize_weight(torch.randn(16, 64), 4, GROUP)
    assert isinstance(stored, QuantizedWeights)
    assert (stored.out_features, stored.in_features) == (16, 64)
