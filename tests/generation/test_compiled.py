"""generate(compile=True): the static-shape decode step, its compilation (once, not per token) and fallbacks."""

import warnings

import pytest
import torch

from tests.generation.helpers import POSITIONS, left_pad, small_model
from tokenloom import GenerationConfig, generate, stream
from tokenloom.compilation import compile_unavailable
from tokenloom.errors import ConfigError
from tokenloom.generation import compiled

GREEDY = dict(do_sample=False)


class CountingBackend:
    """A torch.compile backend that runs the traced graph eagerly and counts compilations."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module


@pytest.fixture
def counting(monkeypatch):
    backend = CountingBackend()
    monkeypatch.setattr(compiled, "BACKEND", backend)
    torch._dynamo.reset()  # earlier tests' compilations must not be reused
    yield backend
    torch._dynamo.reset()


@pytest.mark.parametrize("position", POSITIONS)
def test_the_static_cache_strategy_equals_the_uncached_forward(position):
    model = small_model(position=position)
    ids, mask = left_pad([torch.randint(0, 40, (9,)), torch.randint(0, 40, (6,))])
    with torch.inference_mode():
        reference = model(ids, attention_mask=mask)[:, -1]  # (B, V)
        cache = compiled.StaticKVCache(model.create_cache(2, 16))
        model(ids[:, :-1], attention_mask=mask[:, :-1], cache=cache)  # eager prefill of all but the last
        key_mask = torch.ones(2, 16, dtype=torch.bool)
        key_mask[:, :9] = mask.bool()
        positions = mask.sum(-1, keepdim=True) - 1  # (B, 1): real tokens before the last one
        static = cache.static(torch.tensor([8]), key_mask)  # written at position 8, attending over all 16
        logits = model(ids[:, -1:], positions=positions, cache=static)[:, 0]
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [dict(position="learned"), dict(position="rope"), dict(position="alibi"),
                                     dict(position="rope", qk_norm=True, logit_softcap=2.0, mlp="relu2"),
                                     dict(position="rope", value_embeddings=1, unet_skips=True)],
                         ids=["learned", "rope", "alibi", "speedrun", "speedrun-stack"])
def test_compiled_decoding_compiles_once_and_gives_the_eager_tokens(counting, options):
    model = small_model(**options)
    ids, mask = left_pad([torch.randint(0, 40, (7,)), torch.randint(0, 40, (3,)), torch.randint(0, 40, (5,))])
    eager = generate(model, ids, GenerationConfig(max_new_tokens=20, **GREEDY), attention_mask=mask)
    out = generate(model, ids, GenerationConfig(max_new_tokens=20, compile=True, **GREEDY), attention_mask=mask)
    assert torch.equal(out, eager)
    assert counting.graphs == 1  # 19 compiled steps, one compilation: the shapes are static
    again = generate(model, ids, GenerationConfig(max_new_tokens=18, compile=True, **GREEDY), attention_mask=mask)
    assert torch.equal(again, eager[:, :-2])
    assert counting.graphs == 1  # a similar request reuses it (the cache length is rounded up to 64)


def test_compiled_sampling_and_stopping_equal_eager(counting):
    model = small_model()
    ids = torch.randint(0, 40, (4, 5))
    sampling = dict(max_new_tokens=15, temperature=0.8, top_k=10, seed=3)  # no row stops: the same draws
    eager = generate(model, ids, GenerationConfig(**sampling))
    assert torch.equal(generate(model, ids, GenerationConfig(compile=True, **sampling)), eager)
    stopping = dict(max_new_tokens=15, eos_token_id=int(eager[0, 7]), pad_token_id=0, **GREEDY)
    eager = generate(model, ids, GenerationConfig(**stopping))
    assert (eager == 0).any()  # rows stopped (eager decoding dropped them from the batch)
    assert torch.equal(generate(model, ids, GenerationConfig(compile=True, **stopping)), eager)
    steps = list(stream(model, ids, GenerationConfig(compile=True, **stopping)))
    assert torch.equal(torch.stack(steps, 1), eager[:, 5:5 + len(steps)])


@pytest.mark.skipif(compile_unavailable() is not None, reason=f"torch.compile unavailable: {compile_unavailable()}")
def test_inductor_compiled_decoding_gives_the_eager_tokens():
    torch._dynamo.reset()
    model = small_model(position="rope")
    ids, mask = left_pad([torch.randint(0, 40, (6,)), torch.randint(0, 40, (4,))])
    eager = generate(model, ids, GenerationConfig(max_new_tokens=16, **GREEDY), attention_mask=mask)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = generate(model, ids, GenerationConfig(max_new_tokens=16, compile=True, **GREEDY), attention_mask=mask)
    assert not [w for w in seen if "generate(compile=True)" in str(w.message)]  # compiled for real, no fallback
    assert torch.equal(out, eager)


def test_without_a_compiler_decoding_warns_once_and_runs_eagerly(monkeypatch):
    monkeypatch.setattr(compiled, "compile_unavailable", lambda: "no C++ compiler (g++, c++ or clang++)")
    model = small_model()
    ids = torch.randint(0, 40, (2, 5))
    eager = generate(model, ids, GenerationConfig(max_new_tokens=8, **GREEDY))
    with pytest.warns(UserWarning, match=r"^generate\(compile=True\): no C\+\+ compiler .*; decoding eagerly$") as seen:
        out = generate(model, ids, GenerationConfig(max_new_tokens=8, compile=True, **GREEDY))
    assert len(seen) == 1
    assert torch.equal(out, eager)


def test_a_failing_compilation_warns_and_decoding_goes_on_eagerly(monkeypatch):
    def broken(graph_module, example_inputs):
        raise RuntimeError("the C++ compiler crashed")

    monkeypatch.setattr(compiled, "BACKEND", broken)
    torch._dynamo.reset()
    model = small_model()
    ids = torch.randint(0, 40, (2, 5))
    eager = generate(model, ids, GenerationConfig(max_new_tokens=8, **GREEDY))
    with pytest.warns(UserWarning, match=r"compiling the decode step failed .*; decoding eagerly"):
        out = generate(model, ids, GenerationConfig(max_new_tokens=8, compile=True, **GREEDY))
    torch._dynamo.reset()
    assert torch.equal(out, eager)


def test_linear_attention_models_decode_eagerly_with_a_warning(counting):
    model = small_model(attention="performer")
    ids = torch.randint(0, 40, (1, 5))
    eager = generate(model, ids, GenerationConfig(max_new_tokens=6, **GREEDY))
    with pytest.warns(UserWarning, match="attention='performer' keeps no key/value cache"):
        out = generate(model, ids, GenerationConfig(max_new_tokens=6, compile=True, **GREEDY))
    assert torch.equal(out, eager)
    assert counting.graphs == 0


def test_compile_settings_are_checked():
    with pytest.raises(ConfigError, match="compile must be true or false, got 'yes'"):
        GenerationConfig(compile="yes")
    with pytest.raises(ConfigError, match=r"compile applies to greedy decoding and sampling; beam search "
                                          r"\(num_beams=4\) runs eagerly"):
        GenerationConfig(compile=True, num_beams=4, do_sample=False)


def test_static_cache_length_rounds_up_within_the_context():
    assert compiled.static_cache_length(20, 512) == 64
    assert compiled.static_cache_length(64, 512) == 64
    assert compiled.static_cache_length(65, 100) == 100  # capped by the context
    assert compiled.static_cache_length(100, 100) == 100
    assert compiled.static_cache_length(70, None) == 128


def test_forced_cpu_kernels_get_an_inductor_cache_of_their_own(monkeypatch):
    """Inductor's cache does not key on ATEN_CPU_CAPABILITY: a process forced to other kernels compiles into a
    cache of its own (a kernel compiled for AVX-512 and loaded under avx2 indexed out of bounds, and the other way
    round aborted the test process)."""
    import os

    from tokenloom.compilation import separate_inductor_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    separate_inductor_cache()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # the CPU's own kernels: Inductor's default cache
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "AVX2")
    separate_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("-aten-avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/chosen")
    separate_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/chosen"  # a chosen cache is left alone
