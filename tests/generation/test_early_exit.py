"""Depth-adaptive early exit (tokenloom.generation.early_exit): threshold 1.0 is the full model bit for bit, the
cached one-token decode equals the whole-sequence pass (logits, decisions and the keys and values it stores), a low
threshold exits and leaves what comes before the first exit unchanged, padded batches decode as each row alone, bad
thresholds and models that cannot exit are one-line errors, trained heads train with the model frozen and
round-trip through their safetensors file."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokenloom.errors import CheckpointError, ConfigError, GenerationError
from tokenloom.generation import GenerationConfig, generate
from tokenloom.generation.early_exit import (
    EXIT_HEADS_FILE,
    EarlyExit,
    ExitTally,
    early_exit_logits,
    load_exit_heads,
    save_exit_heads,
)
from tokenloom.nn.exits import ExitHeads, max_probability
from tokenloom.training.exits import layer_states, random_windows, train_exit_heads

from .helpers import left_pad, small_model

L = 4


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread (after the suite's fixture set two): these tiny models run many small ops, each of which a
    second thread only slows down, and on a busy 2-core machine a starved second thread costs each parallel
    region a scheduler slice (measured here: 2 s -> 110 s for one test)."""
    torch.set_num_threads(1)


def exit_model(seed: int = 0, **overrides):
    """A random 4-layer GPT whose output layer is scaled up, so its exit heads' confidences spread from near
    uniform to near certain (a plain random model's are all about 1 / vocab)."""
    model = small_model(seed=seed, **{"num_layers": L, **overrides})
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


def trained_heads(model, seed: int = 1) -> ExitHeads:
    """Trained-kind heads with random norm weights (as if trained): different from the shared ones."""
    c = model.config
    heads = ExitHeads.trained(model.final_norm, c.num_layers, c.norm, c.embed_dim, c.norm_eps)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return heads.eval()


def midway_threshold(model, ids: torch.Tensor, heads: ExitHeads | None = None, layer: int = 1) -> float:
    """A threshold between two neighbouring exit confidences of ``layer`` near their median (so some positions
    exit there and some do not, none of them within float rounding of the threshold)."""
    states = layer_states(model, ids)
    norm = model.final_norm if heads is None or heads.norms is None else heads.norms[layer - 1]
    with torch.no_grad():
        conf = max_probability(model.forward_head(norm(states[layer - 1]))).flatten().sort().values
    i = len(conf) // 2
    return float((conf[i] + conf[i + 1]) / 2)


def cached_run(runner, model, ids: torch.Tensor, prefill: int, mask: torch.Tensor | None = None):
    """Prefill ``prefill`` positions, then one token per call: (logits (B, T, V), layers (B, T), the cache)."""
    B, T = ids.shape
    cache = model.create_cache(B, T)
    outs = [runner.forward_layers(ids[:, :prefill], cache=cache,
                                  attention_mask=None if mask is None else mask[:, :prefill])]
    for t in range(prefill, T):
        outs.append(runner.forward_layers(ids[:, t:t + 1], cache=cache,
                                          attention_mask=None if mask is None else mask[:, :t + 1]))
    return torch.cat([o.logits for o in outs], 1), torch.cat([o.layers for o in outs], 1), cache


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_threshold_one_is_the_full_model_bit_for_bit(position):
    model = exit_model(position=position)
    ids = torch.randint(0, 40, (2, 12))
    with torch.inference_mode():
        full = model(ids)
        for heads in (None, trained_heads(model)):
            out = early_exit_logits(model, ids, 1.0, heads)
            assert torch.equal(out.logits, full) and bool((out.logits.argmax(-1) == full.argmax(-1)).all())
            assert bool((out.layers == L).all())
            # cached: the prefill and the one-token steps are the model's own, bit for bit
            runner = EarlyExit(model, 1.0, heads)
            cache = model.create_cache(2, 12)
            mine = [runner(ids[:, :5], cache=cache)] + [runner(ids[:, t:t + 1], cache=cache) for t in range(5, 12)]
            cache = model.create_cache(2, 12)
            own = [model(ids[:, :5], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(5, 12)]
            assert all(torch.equal(a, b) for a, b in zip(mine, own, strict=True))
    tally = ExitTally(L)
    config = GenerationConfig(max_new_tokens=12, do_sample=False)
    exiting = generate(model, ids[:1, :4], GenerationConfig(max_new_tokens=12, do_sample=False, exit_threshold=1.0),
                       exit_heads=trained_heads(model), exit_tally=tally)
    assert torch.equal(exiting, generate(model, ids[:1, :4], config))
    assert tally.positions == 11 and tally.mean_layers == L  # the steps after the prefill's token


@pytest.mark.parametrize(("position", "placement", "batch", "options"),
                         [("learned", "pre", 1, {}), ("rope", "pre", 1, {}), ("learned", "post", 1, {}),
                          ("learned", "pre", 2, {}), ("rope", "pre", 1, dict(qk_norm=True, logit_softcap=3.0)),
                          ("rope", "pre", 1, dict(value_embeddings=1))])
def test_cached_decoding_equals_the_whole_sequence_pass(position, placement, batch, options):
    model = exit_model(position=position, norm_placement=placement, **options)
    ids = torch.randint(0, 40, (batch, 16), generator=torch.Generator().manual_seed(3))
    heads = trained_heads(model) if placement == "pre" else None
    threshold = midway_threshold(model, ids, heads)
    with torch.inference_mode():
        whole = early_exit_logits(model, ids, threshold, heads)
        runner = EarlyExit(model, threshold, heads)
        logits, layers, cache = cached_run(runner, model, ids, prefill=4)
        assert torch.equal(layers, whole.layers)
        assert 1.0 < whole.layers.float().mean() < L - 0.5  # positions exit, at different layers
        if batch == 1:  # steps where the row exited: the layers above only stored keys and values (frozen_block)
            assert bool((layers[0, 4:] < L).any())
        torch.testing.assert_close(logits, whole.logits, rtol=0, atol=2e-5)
        assert torch.equal(logits.argmax(-1), whole.logits.argmax(-1))
        # the keys and values the steps stored (frozen states' included) are the ones a whole-sequence prefill stores
        prefilled = model.create_cache(batch, 16)
        runner.forward_layers(ids, cache=prefilled)
        torch.testing.assert_close(cache.kv, prefilled.kv, rtol=0, atol=2e-5)


@pytest.mark.parametrize("kind", ["shared", "trained"])
def test_a_low_threshold_exits_and_changes_nothing_before_the_first_exit(kind):
    model = exit_model()
    heads = trained_heads(model) if kind == "trained" else ExitHeads.shared(L)
    norms = heads.norm_functions(model.final_norm, plain=False)
    ids = torch.randint(0, 40, (3, 16), generator=torch.Generator().manual_seed(5))
    threshold = midway_threshold(model, ids, heads)
    with torch.inference_mode():
        full = model(ids)
        out = early_exit_logits(model, ids, threshold, heads)
        states = layer_states(model, ids)  # the full model's states (nothing frozen)
    assert out.layers.float().mean() < L - 0.5 and bool((out.layers == L).any())  # some exit, some run to the end
    for row in range(3):
        exits = (out.layers[row] < L).nonzero().view(-1)
        assert len(exits) > 0
        first = int(exits[0])
        # positions before the first exit see no frozen state: the full model's logits
        torch.testing.assert_close(out.logits[row, :first], full[row, :first], rtol=0, atol=1e-5)
        # the first exit: the exit head of its layer on the full model's state there
        layer = int(out.layers[row, first])
        with torch.inference_mode():
            head = model.forward_head(norms[layer - 1](states[layer - 1][row, first]))
        torch.testing.assert_close(out.logits[row, first], head, rtol=0, atol=1e-5)
        assert not torch.allclose(out.logits[row, first], full[row, first], atol=1e-3)


def test_batched_left_padded_prompts_decode_as_each_alone():
    model = exit_model(seed=2)
    rows = [torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 8, 5)]
    ids, mask = left_pad(rows)
    threshold = midway_threshold(model, ids[1:2, 0:8])
    config = GenerationConfig(max_new_tokens=10, do_sample=False, exit_threshold=threshold)
    tally = ExitTally(L)
    batched = generate(model, ids, config, attention_mask=mask, exit_tally=tally)
    assert tally.mean_layers < L - 0.2  # it exits
    for i, row in enumerate(rows):
        alone = generate(model, row[None], config)
        assert torch.equal(batched[i, ids.shape[1]:], alone[0, len(row):])


@pytest.mark.parametrize("value", [0, -0.1, 1.5, float("nan"), True])
def test_an_exit_threshold_outside_zero_one_is_a_one_line_error(value):
    with pytest.raises(ConfigError) as err:
        GenerationConfig(exit_threshold=value)
    message = str(err.value)
    assert "exit_threshold" in message and repr(value) in message and "(0, 1]" in message and "\n" not in message
    with pytest.raises(GenerationError, match=r"\(0, 1\]"):
        EarlyExit(exit_model(), value)


def test_beam_search_and_compile_refuse_early_exit_in_one_line():
    with pytest.raises(ConfigError, match="beam search") as err:
        GenerationConfig(exit_threshold=0.9, num_beams=3, do_sample=False)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="compile"):
        GenerationConfig(exit_threshold=0.9, compile=True)
    with pytest.raises(GenerationError, match="exit_threshold"):  # heads without a threshold: nothing would use them
        generate(exit_model(), torch.zeros(1, 2, dtype=torch.long), GenerationConfig(max_new_tokens=1),
                 exit_heads=ExitHeads.shared(L))


def test_a_model_that_cannot_exit_early_refuses_in_one_line():
    from tokenloom.models.rnn import RNNLM, RNNConfig

    rnn = RNNLM(RNNConfig(vocab_size=20, num_layers=2, embed_dim=16)).eval()
    config = GenerationConfig(max_new_tokens=3, do_sample=False, exit_threshold=0.9)
    with pytest.raises(GenerationError, match="RNNLM cannot exit early") as err:
        generate(rnn, torch.zeros(1, 2, dtype=torch.long), config)
    assert "\n" not in str(err.value)
    generate(exit_model(), torch.zeros(1, 2, dtype=torch.long), config)  # a GPT can


def test_trained_heads_train_with_the_model_frozen_and_round_trip_through_safetensors(tmp_path):
    model = exit_model()
    c = model.config
    before = {k: v.clone() for k, v in model.state_dict().items()}
    heads = ExitHeads.trained(model.final_norm, L, c.norm, c.embed_dim, c.norm_eps)
    untrained = {k: v.clone() for k, v in heads.state_dict().items()}
    ids = torch.randint(0, 40, (2000,), generator=torch.Generator().manual_seed(0)).numpy()
    losses = train_exit_heads(model, heads, random_windows(ids, 4, 16, seed=0), steps=8, lr=3e-2)
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert any(not torch.equal(v, untrained[k]) for k, v in heads.state_dict().items())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the backbone did not move
    assert all(p.requires_grad for p in model.parameters()) and not model.training

    path = save_exit_heads(heads, tmp_path, {"steps": "8"})
    assert path.name == EXIT_HEADS_FILE and not (tmp_path / (EXIT_HEADS_FILE + ".tmp")).exists()
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["kind"] == "trained" and f.metadata()["num_layers"] == str(L)
        assert set(f.keys()) == set(heads.state_dict())
    loaded = load_exit_heads(tmp_path, model)
    assert all(torch.equal(v, heads.state_dict()[k]) for k, v in loaded.state_dict().items())
    ids = torch.randint(0, 40, (2, 12))
    threshold = midway_threshold(model, ids, heads)
    with torch.inference_mode():
        mine, theirs = early_exit_logits(model, ids, threshold, heads), early_exit_logits(model, ids, threshold, loaded)
        shared = early_exit_logits(model, ids, threshold)
    assert torch.equal(mine.logits, theirs.logits) and torch.equal(mine.layers, theirs.layers)
    assert not torch.equal(mine.logits, shared.logits)  # trained heads are not the shared ones

    other = exit_model(embed_dim=48)  # heads of another width
    with pytest.raises(CheckpointError, match="another shape") as err:
        load_exit_heads(tmp_path, other)
    assert "\n" not in str(err.value)
    save_file({"norms.0.weight": torch.ones(3)}, str(path))
    with pytest.raises(CheckpointError, match="another shape"):
        load_exit_heads(tmp_path, model)
    with pytest.raises(CheckpointError, match="fit-exits"):
        load_exit_heads(tmp_path / "none", model)


def test_generate_command_exits_early_and_reports_the_mean_layers(tmp_path, capsys):
    from tokenloom.checkpoint import write_checkpoint
    from tokenloom.cli.main import main
    from tokenloom.data import create_tokenizer
    from tokenloom.models.factory import model_config_to_dict

    model = exit_model()
    text = "abcdefghij klmnopqrstuvwxyz ABCDEFGHIJKL" * 20
    tokenizer = create_tokenizer("char", text)
    ckpt = tmp_path / "lm"
    write_checkpoint(ckpt, model, {"model": model_config_to_dict("gpt", model.config),
                                   "data": {"path": str(tmp_path / "text.txt"), "val_fraction": 0.1}}, tokenizer)
    (tmp_path / "text.txt").write_text(text)
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--prompt", "abc", "--max-new-tokens", "6", "--greedy",
                 "--exit-threshold", "0.2", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "early exit at 0.2 (shared heads):" in err and f"of {L} layers per token" in err
    assert main(["generate", str(ckpt), "--exit-threshold", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "exit_threshold must be in (0, 1]" in err and err.count("\n") == 1
    assert main(["generate", str(ckpt), "--exit-threshold", "0.9", "--exit-heads", "trained"]) == 2
    assert "tokenloom fit-exits" in capsys.readouterr().err
    assert main(["fit-exits", str(ckpt), "--steps", "2", "--batch-size", "2", "--seq-len", "8"]) == 0
    assert (ckpt / EXIT_HEADS_FILE).is_file()
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--prompt", "abc", "--max-new-tokens", "4", "--greedy",
                 "--exit-threshold", "0.9", "--verbose"]) == 0
    assert "(trained heads)" in capsys.readouterr().err  # found next to the checkpoint
