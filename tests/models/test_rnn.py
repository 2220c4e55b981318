"""The recurrent (LSTM / GRU) language model (issue 29): its carried state decodes what the full forward computes,
left padding changes no state, beam search finds the exhaustive optimum, and it trains, checkpoints and decodes
through the same Trainer, task, checkpoints and generation as GPT. Tiny sizes: the whole file runs in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.generation.helpers import left_pad, reference_greedy
from tests.generation.test_beam import exhaustive, new_tokens

from tokenloom.checkpoint import load_model, write_checkpoint
from tokenloom.errors import ConfigError
from tokenloom.generation import GenerationConfig, beam_search, generate
from tokenloom.models import RNNLM, RNNConfig
from tokenloom.models.factory import model_config_from_dict, model_config_to_dict
from tokenloom.nn.recurrent import RecurrentState
from tokenloom.tasks import LMTask

ROOT = Path(__file__).resolve().parents[2]
CELLS = ["lstm", "gru"]
GREEDY = dict(do_sample=False)


def peaked(cell: str = "lstm", vocab_size: int = 17, seed: int = 0, std: float = 0.5, head: float = 4.0,
           **overrides) -> RNNLM:
    """A tiny random RNN LM with large weights: a state that moves with every token and peaked, varied next-token
    distributions (no near-ties that float noise could decide). Untied: a random tied model repeats itself."""
    torch.manual_seed(seed)
    config = dict(vocab_size=vocab_size, cell=cell, num_layers=2, embed_dim=32, tie_embeddings=False,
                  max_seq_len=64)
    model = RNNLM(RNNConfig(**{**config, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        model.lm_head.weight.mul_(head)
    return model


def stepwise(model: RNNLM, ids: torch.Tensor, prefill: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of ``ids`` (B, T): ``prefill`` positions in one call, then one per call, through one cache; ``mask``
    (B, T) is given over the cached + new positions, as generate gives it."""
    cache = model.create_cache(ids.shape[0])
    out = []
    for start, end in [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.shape[1])]:
        out.append(model(ids[:, start:end], attention_mask=None if mask is None else mask[:, :end], cache=cache))
    assert cache.length == ids.shape[1]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("cell", CELLS)
@torch.no_grad()
def test_cached_generation_equals_full_recompute(cell):
    # the test: each token decoded from the carried state is the argmax of a full forward over the whole
    # sequence so far
    model = peaked(cell)
    prompts = torch.randint(0, 17, (2, 5), generator=torch.Generator().manual_seed(1))
    out = generate(model, prompts, GenerationConfig(max_new_tokens=10, **GREEDY))
    for row in range(2):
        assert out[row].tolist() == reference_greedy(model, prompts[row], 10).tolist()
    assert len(set(out[:, 5:].flatten().tolist())) > 2  # the model does not just repeat one token


@pytest.mark.parametrize("cell, overrides", [("lstm", {}), ("gru", {}), ("lstm", {"tie_embeddings": True,
                                                                                    "hidden_dim": 24})],
                         ids=["lstm", "gru", "lstm-tied-projected"])
@torch.no_grad()
def test_prefill_and_steps_equal_the_full_forward(cell, overrides):
    model = peaked(cell, **overrides)
    ids = torch.randint(0, 17, (3, 11), generator=torch.Generator().manual_seed(2))
    full = model(ids)
    for prefill in (1, 4, 11):
        torch.testing.assert_close(stepwise(model, ids, prefill), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cell", CELLS)
@torch.no_grad()
def test_left_padding_changes_no_state(cell):
    # rows of 9, 3 and 6 tokens left-padded to 9: uncached with the mask, prefill + steps with the mask (prefill 2:
    # the 3-token row's prefill is padding only, and its steps start with padding), each equal to the row alone
    model = peaked(cell)
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 17, (n,), generator=gen) for n in (9, 3, 6)]
    ids, mask = left_pad(rows, pad=7)
    T = ids.shape[1]
    for got in (model(ids, attention_mask=mask), stepwise(model, ids, 2, mask), stepwise(model, ids, 6, mask)):
        for i, row in enumerate(rows):
            torch.testing.assert_close(got[i, T - len(row):], model(row[None])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cell", CELLS)
def test_batched_left_padded_generation_equals_one_by_one(cell, monkeypatch):
    # an EOS ends row 0 early: the finished row leaves the batch (cache.select) while the others decode on
    selected = []
    select = RecurrentState.select
    monkeypatch.setattr(RecurrentState, "select",
                        lambda self, index: (selected.append(len(index)), select(self, index)))
    model = peaked(cell, seed=4)
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, 17, (n,), generator=gen) for n in (7, 2, 4)]
    free = generate(model, rows[0][None], GenerationConfig(max_new_tokens=8, **GREEDY))
    eos = int(free[0, 7 + 2])  # row 0's third new token: it stops after at most three
    config = GenerationConfig(max_new_tokens=8, eos_token_id=eos, pad_token_id=0, **GREEDY)
    ids, mask = left_pad(rows, pad=5)
    batched = generate(model, ids, config, attention_mask=mask)
    T = ids.shape[1]
    for i, row in enumerate(rows):
        alone = generate(model, row[None], config)[0]
        n = len(alone) - len(row)
        assert batched[i, T - len(row):T + n].tolist() == alone.tolist(), i
        assert (batched[i, T + n:] == 0).all()
    assert len(free[0]) - len(rows[0]) == 8 and (batched[0, T + 3:] == 0).all()
    assert selected and max(selected) < 3  # stopped rows left the batch; the others decoded on


@torch.no_grad()
def test_one_beam_equals_greedy_and_top_k_1_sampling_equals_greedy():
    model = peaked("lstm", seed=5)
    gen = torch.Generator().manual_seed(5)
    ids, mask = left_pad([torch.randint(0, 17, (n,), generator=gen) for n in (5, 2, 4)], pad=3)
    greedy = generate(model, ids, GenerationConfig(max_new_tokens=7, **GREEDY), attention_mask=mask)
    beam = beam_search(model, ids, GenerationConfig(max_new_tokens=7, num_beams=1, **GREEDY), attention_mask=mask)
    assert torch.equal(beam.sequences[:, 0], greedy)
    sampled = generate(model, ids, GenerationConfig(max_new_tokens=7, do_sample=True, top_k=1, seed=0),
                       attention_mask=mask)
    assert torch.equal(sampled, greedy)


@pytest.mark.parametrize("cell", CELLS)
def test_beam_search_over_a_padded_batch_equals_each_prompt_alone(cell):
    # the cache's rows are reordered by the chosen beams (cache.reorder) and dropped as prompts finish (select)
    model = peaked(cell, seed=10)
    gen = torch.Generator().manual_seed(10)
    rows = [torch.randint(0, 17, (n,), generator=gen) for n in (6, 2, 4)]
    ids, mask = left_pad(rows, pad=1)
    config = GenerationConfig(max_new_tokens=5, num_beams=3, num_return_sequences=2, eos_token_id=3,
                              pad_token_id=0, **GREEDY)
    batched = beam_search(model, ids, config, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = beam_search(model, row[None], config)
        for k in range(2):
            assert new_tokens(batched, ids.shape[1], i, k) == new_tokens(alone, len(row), 0, k), (i, k)
        torch.testing.assert_close(batched.scores[i], alone.scores[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cell", CELLS)
def test_beam_search_equals_exhaustive_search(cell):
    # with num_beams >= V^(n-1) beam search keeps every prefix (its cache reordered each step), so it must find the
    # exact best hypotheses the uncached forward scores
    V, n, eos = 5, 3, 4
    model = peaked(cell, vocab_size=V, seed=6, std=0.6, head=1.5)
    prompt = torch.tensor([2, 1, 3])
    config = GenerationConfig(max_new_tokens=n, num_beams=V ** (n - 1), num_return_sequences=6, eos_token_id=eos,
                              pad_token_id=0, length_penalty=1.0, **GREEDY)
    out = beam_search(model, prompt[None], config)
    want = exhaustive(model, prompt, n, V, eos, 1.0)[:7]
    scores = [s for s, _ in want]
    assert min(a - b for a, b in zip(scores, scores[1:], strict=False)) > 1e-4  # no near-ties for rounding to decide
    assert [new_tokens(out, len(prompt), 0, k) for k in range(6)] == [list(h) for _, h in want[:6]]
    torch.testing.assert_close(out.scores[0], torch.tensor(scores[:6]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cell", CELLS)
@torch.no_grad()
def test_causality(cell):
    model = peaked(cell)
    ids = torch.randint(0, 17, (2, 10), generator=torch.Generator().manual_seed(7))
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 17
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=1e-5, rtol=0)
    assert (a[:, 6:] - b[:, 6:]).abs().amax() > 1e-3


@pytest.mark.parametrize("cell", CELLS)
def test_a_tiny_model_overfits_one_batch(cell):
    torch.manual_seed(8)
    model = RNNLM(RNNConfig(vocab_size=17, cell=cell, num_layers=1, embed_dim=32, max_seq_len=16)).train()
    task = LMTask(None, batch_size=4, seq_len=12)
    data = torch.randint(0, 17, (4, 13), generator=torch.Generator().manual_seed(8))
    batch = (data[:, :-1], data[:, 1:])
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    first = None
    for _ in range(50):
        loss, count = task.loss(model, batch)
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert count == 48
    assert loss.item() < 0.2 * first, (first, loss.item())


def test_trains_checkpoints_and_generates_through_the_shared_pipeline(tmp_path):
    from tokenloom.training import load_run_config
    from tokenloom.training.setup import setup_run

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 30)
    recipe = {"model": {"family": "rnn", "cell": "gru", "num_layers": 2, "embed_dim": 24, "hidden_dim": 16,
                        "max_seq_len": 32, "dropout": 0.1},
              "data": {"path": str(corpus)},
              "train": {"max_steps": 4, "batch_size": 4, "seq_len": 16, "lr": 3e-3, "warmup_steps": 1,
                        "eval_every": 4, "eval_batches": 2, "checkpoint_every": 4, "log_every": 2,
                        "precision": "fp32"}}
    trainer = setup_run(load_run_config(recipe), tmp_path / "run", show_progress=False)
    trainer.fit()
    loaded, config = load_model(tmp_path / "run")
    assert config["model"]["family"] == "rnn" and isinstance(loaded, RNNLM)
    x = torch.randint(0, loaded.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), trainer.model.eval()(x), atol=0, rtol=0)
    assert generate(loaded, x, GenerationConfig(max_new_tokens=4, **GREEDY)).shape == (2, 13)


@pytest.mark.parametrize("cell", CELLS)
def test_checkpoint_round_trip_with_a_tied_projected_head(tmp_path, cell):
    model = peaked(cell, tie_embeddings=True, hidden_dim=20)
    assert model.lm_head.weight is model.tok_embed.weight and model.proj.weight.shape == (32, 20)
    write_checkpoint(tmp_path / "ckpt", model, {"task": "lm", "model": model_config_to_dict("rnn", model.config)})
    loaded, _ = load_model(tmp_path / "ckpt")
    x = torch.randint(0, 17, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert loaded.lm_head.weight is loaded.tok_embed.weight


def test_compile_is_declined_with_a_warning_and_decoding_runs_eagerly():
    # generate(compile=True) makes a static key/value cache; a recurrent state is not one
    model = peaked("lstm")
    ids = torch.randint(0, 17, (2, 4), generator=torch.Generator().manual_seed(9))
    eager = generate(model, ids, GenerationConfig(max_new_tokens=5, **GREEDY))
    with pytest.warns(UserWarning, match=r"RNNLM decodes over a RecurrentState, not a key/value cache"):
        out = generate(model, ids, GenerationConfig(max_new_tokens=5, compile=True, **GREEDY))
    assert torch.equal(out, eager)


def test_the_server_refuses_it_in_one_line():
    from tokenloom.data import create_tokenizer
    from tokenloom.serving.engine import Engine

    with pytest.raises(ConfigError, match=r"^RNNLM models cannot be served: .* over a RecurrentState \(use "):
        Engine(peaked("gru"), create_tokenizer("char", "abcdefghijklmnopq"))


def test_recurrent_state_rows():
    for cell_state in (True, False):
        cache = RecurrentState(2, 3, 4, cell_state)
        cache.store((torch.arange(24.).view(2, 3, 4), -torch.arange(24.).view(2, 3, 4)) if cell_state
                    else torch.arange(24.).view(2, 3, 4))
        cache.advance(5)
        cache.reorder(torch.tensor([2, 2, 0]))
        assert cache.batch_size == 3 and cache.h[:, :, 0].tolist() == [[8, 8, 0], [20, 20, 12]]
        cache.select(torch.tensor([1]))
        assert cache.batch_size == 1 and cache.h[:, 0, 0].tolist() == [8, 20]
        if cell_state:
            assert cache.c[:, 0, 0].tolist() == [-8, -20] and isinstance(cache.state, tuple)
        cache.reset()
        assert cache.length == 0 and not cache.h.any() and cache.max_len is None


@pytest.mark.parametrize("fields, message", [
    ({"cell": "rnnx"}, r"^cell: unknown recurrent cell 'rnnx'.*known: gru, lstm$"),
    ({"num_layers": 0}, r"^num_layers must be a positive integer, got 0$"),
    ({"hidden_dim": 0}, r"^hidden_dim must be a positive integer or null, got 0$"),
    ({"dropout": 1.0}, r"^dropout must be in \[0, 1\), got 1.0$"),
])
def test_bad_configs_are_one_line_errors(fields, message):
    with pytest.raises(ConfigError, match=message) as err:
        RNNConfig(**fields)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^model\.") as err:
        model_config_from_dict({"family": "rnn", **fields})
    assert "\n" not in str(err.value)


def test_the_recipe_is_the_gpt_recipes_size():
    from tokenloom.training import load_run_config

    sizes = {}
    for name in ("shakespeare-char", "shakespeare-char-lstm"):
        config = load_run_config(str(ROOT / "configs" / f"{name}.yaml"))
        family, model_config = model_config_from_dict(config.model)
        with torch.device("meta"):
            from tokenloom.models.registry import MODELS

            sizes[family] = sum(p.numel() for p in MODELS.get(family)[1](model_config).parameters())
        assert config.train.seq_len <= model_config.max_seq_len
    assert 0.9 < sizes["rnn"] / sizes["gpt"] < 1.1, sizes


@pytest.mark.parametrize("fields", [{}, {"cell": "gru", "hidden_dim": 300, "tie_embeddings": False},
                                    {"embed_dim": 256, "hidden_dim": 512, "num_layers": 3}])
def test_the_memory_estimate_is_a_close_lower_bound(fields):
    # the budgets (tokenloom.models.sizes) refuse a model that cannot fit before it is built
    from tokenloom.models.factory import create_model
    from tokenloom.models.sizes import parameter_count

    config = RNNConfig(**fields)
    params = create_model("rnn", config, init=False).num_params()
    assert 0.98 * params <= parameter_count(config) <= params
    with pytest.raises(ConfigError, match=r"^model\.embed_dim=|^model\.num_layers=.* needs about"):
        create_model("rnn", RNNConfig(embed_dim=2 ** 20, num_layers=64))
