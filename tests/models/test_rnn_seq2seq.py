"""The recurrent encoder-decoder with attention (issue 29, part 4): cached decoding computes the teacher-forced logits,
a padded source decodes exactly as alone (greedy and beam), beam search finds the exhaustive optimum, the cache keeps
each sentence's rows together, and it trains, checkpoints and translates through the translation task, Trainer and
checkpoints the Transformer uses. Tiny sizes: the whole file runs in seconds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tests.generation.test_beam import exhaustive, new_tokens

from tokenloom.checkpoint import load_model
from tokenloom.errors import ConfigError, GenerationError
from tokenloom.generation import GenerationConfig, beam_search, generate
from tokenloom.models import MODELS, RNNEncoderDecoder, RNNSeq2SeqCache, RNNSeq2SeqConfig
from tokenloom.models.factory import model_config_from_dict

ROOT = Path(__file__).resolve().parents[2]
GREEDY = dict(do_sample=False)
VARIANTS = {  # cell, attention, bridge, bidirectional encoder, embeddings
    "lstm-general": {},
    "gru-dot": dict(cell="gru", attention="dot"),
    "lstm-concat-unidirectional": dict(attention="concat", bidirectional=False, bridge="zeros", encoder_layers=1,
                                       num_layers=1, share_embeddings=False),
    "lstm-tied-projected": dict(tie_embeddings=True, hidden_dim=20),
}


def make(seed: int = 0, vocab_size: int = 19, std: float = 0.5, head: float = 2.0, **overrides) -> RNNEncoderDecoder:
    """A tiny random model with large weights: states that move with every token and peaked, varied next-token
    distributions (no near-ties that float noise could decide)."""
    torch.manual_seed(seed)
    config = dict(vocab_size=vocab_size, embed_dim=12, hidden_dim=16, encoder_layers=2, num_layers=2, dropout=0.0,
                  tie_embeddings=False, max_source_len=16, max_target_len=16)
    model = RNNEncoderDecoder(RNNSeq2SeqConfig(**{**config, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        model.lm_head.weight.mul_(head)
    return model


def sources(lengths: list[int], seed: int = 1, vocab_size: int = 19) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, S) sources of ``lengths`` tokens (ids >= 3) and their (B, S) mask."""
    gen = torch.Generator().manual_seed(seed)
    S = max(lengths)
    mask = (torch.arange(S)[None] < torch.tensor(lengths)[:, None]).long()
    return torch.randint(3, vocab_size, (len(lengths), S), generator=gen) * mask, mask


def target(B: int, T: int, seed: int = 2) -> torch.Tensor:
    ids = torch.randint(3, 19, (B, T), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 1  # BOS
    return ids


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_cached_steps_equal_teacher_forcing(variant):
    # one token at a time through decoder_for's cache, for one row per sentence and for groups of 3 (beams sharing
    # their sentence's memory), gives the teacher-forced logits
    model = make(**VARIANTS[variant])
    src, mask = sources([7, 4, 6])
    tgt = target(3, 6)
    full = model(src, tgt, mask)
    for group in (1, 3):
        decoder = model.decoder_for(src, mask)
        cache = decoder.create_cache(3 * group)
        assert isinstance(cache, RNNSeq2SeqCache) and cache.group == group
        rows = tgt.repeat_interleave(group, 0)
        steps = torch.cat([decoder(rows[:, t:t + 1], cache=cache) for t in range(6)], dim=1)
        torch.testing.assert_close(steps, full.repeat_interleave(group, 0), atol=1e-5, rtol=1e-5)
        assert cache.length == 6
        torch.testing.assert_close(decoder(rows), steps, atol=1e-5, rtol=1e-5)  # uncached, rows folded per sentence
    assert full.abs().amax() > 1.0  # peaked logits, not a near-constant model


@pytest.mark.parametrize("variant", ["lstm-general", "gru-dot"])
@torch.no_grad()
def test_the_encoder_gives_a_padded_sentence_its_own_states(variant):
    # packed: the forward direction stops at each sentence's last token and the backward one starts there
    model = make(**VARIANTS[variant])
    src, mask = sources([7, 3, 5])
    padded = model.encode(src, mask)
    for i, n in enumerate([7, 3, 5]):
        alone = model.encode(src[i:i + 1, :n])
        torch.testing.assert_close(padded.states[i, :n], alone.states[0], atol=1e-6, rtol=1e-6)
        assert not padded.states[i, n:].any()
        for a, b in zip(padded.initial if variant.startswith("lstm") else [padded.initial],
                        alone.initial if variant.startswith("lstm") else [alone.initial], strict=True):
            torch.testing.assert_close(a[:, i], b[:, 0], atol=1e-6, rtol=1e-6)
    with pytest.raises(GenerationError, match="right-padded"):
        model.encode(src.flip(1), mask.flip(1))


def _eos_and_batch(model):
    """Sources of 7, 2, 5, 4 tokens and, as EOS, a token the greedy decodings produce often: sentences end at
    different steps, so finished ones leave the batch while the others decode on."""
    src, mask = sources([7, 2, 5, 4], seed=5)
    bos = torch.full((4, 1), 1)
    free = generate(model.decoder_for(src, mask), bos, GenerationConfig(max_new_tokens=12, **GREEDY))
    return src, mask, bos, int(free[:, 1:].flatten().mode().values)


@pytest.mark.parametrize("beams", [1, 3])
def test_a_padded_batch_decodes_each_sentence_as_alone(beams, monkeypatch):
    selected = []
    select = RNNSeq2SeqCache.select
    monkeypatch.setattr(RNNSeq2SeqCache, "select", lambda self, index: (selected.append(len(index)),
                                                                         select(self, index)))
    model = make(seed=3)
    src, mask, bos, eos = _eos_and_batch(model)
    config = GenerationConfig(max_new_tokens=12, num_beams=beams, eos_token_id=eos, pad_token_id=0, **GREEDY)
    batched = generate(model.decoder_for(src, mask), bos, config)
    lengths = []
    for i, n in enumerate(mask.sum(1).tolist()):
        alone = generate(model.decoder_for(src[i:i + 1, :n]), bos[:1], config)[0]
        assert batched[i, :len(alone)].tolist() == alone.tolist(), i
        assert (batched[i, len(alone):] == 0).all()
        lengths.append(len(alone))
    assert len(set(lengths)) > 1 and selected  # sentences ended at different steps and left the batch
    if beams > 1:  # the two best hypotheses and their scores too
        two = GenerationConfig(max_new_tokens=8, num_beams=3, num_return_sequences=2, eos_token_id=eos, pad_token_id=0,
                               **GREEDY)
        out = beam_search(model.decoder_for(src, mask), bos, two)
        for i, n in enumerate(mask.sum(1).tolist()):
            alone = beam_search(model.decoder_for(src[i:i + 1, :n]), bos[:1], two)
            for k in range(2):
                assert new_tokens(out, 1, i, k) == new_tokens(alone, 1, 0, k), (i, k)
            torch.testing.assert_close(out.scores[i], alone.scores[0], atol=1e-5, rtol=1e-5)


def test_one_beam_equals_greedy():
    model = make(seed=4)
    src, mask, bos, eos = _eos_and_batch(model)
    config = dict(max_new_tokens=12, eos_token_id=eos, pad_token_id=0, **GREEDY)
    greedy = generate(model.decoder_for(src, mask), bos, GenerationConfig(**config))
    beam = beam_search(model.decoder_for(src, mask), bos, GenerationConfig(num_beams=1, **config))
    width = greedy.shape[1]
    assert torch.equal(beam.sequences[:, 0, :width], greedy) and not beam.sequences[:, 0, width:].any()


@pytest.mark.parametrize("variant", ["lstm-general", "gru-dot"])
def test_beam_search_equals_exhaustive_search(variant):
    # with num_beams >= V^(n-1) beam search keeps every prefix (its cache reordered each step), so it must find the
    # exact best hypotheses that the uncached decoder scores
    V, n, eos = 5, 3, 4
    model = make(vocab_size=V, seed=6, std=0.6, head=1.0, **VARIANTS[variant])
    src, mask = sources([4], seed=6, vocab_size=V)
    decoder = model.decoder_for(src, mask)
    prompt = torch.tensor([1])
    config = GenerationConfig(max_new_tokens=n, num_beams=V ** (n - 1), num_return_sequences=6, eos_token_id=eos,
                              pad_token_id=0, length_penalty=1.0, **GREEDY)
    out = beam_search(decoder, prompt[None], config)
    want = exhaustive(decoder, prompt, n, V, eos, 1.0)[:7]
    scores = [s for s, _ in want]
    assert min(a - b for a, b in zip(scores, scores[1:], strict=False)) > 1e-4  # no near-ties for rounding to decide
    assert [new_tokens(out, 1, 0, k) for k in range(6)] == [list(h) for _, h in want[:6]]
    torch.testing.assert_close(out.scores[0], torch.tensor(scores[:6]), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_reorder_and_select_keep_each_sentences_rows_together():
    model = make()
    src, mask = sources([6, 3, 5])
    decoder = model.decoder_for(src, mask)
    cache = decoder.create_cache(6)  # 2 rows per sentence
    decoder(target(6, 2), cache=cache)  # rows now hold different states
    h, feed, states = cache.h.clone(), cache.feed.clone(), cache.memory.states
    cache.reorder(torch.tensor([1, 1, 2, 3, 5, 4]))
    assert torch.equal(cache.h, h[:, [1, 1, 2, 3, 5, 4]]) and torch.equal(cache.feed, feed[[1, 1, 2, 3, 5, 4]])
    with pytest.raises(GenerationError, match="within a source sentence's group"):
        cache.reorder(torch.tensor([2, 1, 0, 3, 4, 5]))
    h, c = cache.h.clone(), cache.c.clone()
    cache.select(torch.tensor([5, 4, 1, 1]))  # sentences 2 and 0, rows reordered within each
    assert cache.batch_size == 4 and torch.equal(cache.h, h[:, [5, 4, 1, 1]])
    assert torch.equal(cache.c, c[:, [5, 4, 1, 1]])
    assert torch.equal(cache.memory.states, states[[2, 0]]) and torch.equal(cache.memory.mask, mask[[2, 0]].bool())
    with pytest.raises(GenerationError, match="keeps whole source sentences"):
        cache.select(torch.tensor([0, 2]))  # rows of two different sentences in one group
    # decoding on from the kept rows is decoding those sentences' rows alone
    kept = model.decoder_for(src[[2, 0]], mask[[2, 0]])
    fresh = kept.create_cache(4)
    tgt = target(6, 3, seed=7)
    kept(tgt[[5, 4, 1, 1], :2], cache=fresh)
    cache.reset()
    torch.testing.assert_close(decoder(tgt[[5, 4, 1, 1], :2], cache=cache), kept(tgt[[5, 4, 1, 1], :2]))
    with pytest.raises(GenerationError, match="chunk_overlap=8"):
        model.decoder_for(src, mask, chunk_overlap=8)


# ---- training, checkpoints, translate -------------------------------------------------------------------------

def _write_pairs(root: Path) -> None:
    rng = random.Random(0)
    words = "red blue green house dog cat runs sleeps".split()
    for name, n in (("train", 120), ("val", 8)):
        pairs = [rng.choices(words, k=rng.randint(2, 5)) for _ in range(n)]
        (root / f"{name}.xx").write_text("".join(" ".join(p) + "\n" for p in pairs))
        (root / f"{name}.yy").write_text("".join(" ".join(reversed(p)).upper() + "\n" for p in pairs))


TINY = {"family": "rnn_seq2seq", "embed_dim": 16, "hidden_dim": 24, "encoder_layers": 1, "num_layers": 1,
        "dropout": 0.0}


def test_a_tiny_model_overfits_a_few_pairs_through_the_translation_task(tmp_path):
    from tokenloom.tasks.translation import TranslationDataConfig, TranslationTask

    _write_pairs(tmp_path)
    data = TranslationDataConfig(dir=str(tmp_path), source_lang="xx", target_lang="yy", test=[], vocab_size=300,
                                 max_source_len=16, max_target_len=16, max_tokens=64, bleu=False)
    torch.manual_seed(0)
    task, model, _, section = TranslationTask.setup(data, {**TINY, "embed_dim": 32, "hidden_dim": 32}, tmp_path,
                                                    batch_size=1, seq_len=None, label_smoothing=0.0, eval_batches=None)
    assert section["family"] == "rnn_seq2seq" and isinstance(model, RNNEncoderDecoder)
    batch = task.get_batch()
    assert (batch.source_mask == 0).any()  # padded sources
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    model.train()
    losses = []
    for _ in range(25):
        loss, count = task.loss(model, batch)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert count == int(batch.target_mask.sum())
    # measured: 5.70 -> 0.01, far below the 2.49 of predicting the batch's token frequencies whatever the context
    assert losses[-1] < 0.05 * losses[0], losses


def test_trains_checkpoints_and_translates_through_the_shared_pipeline(tmp_path):
    from tokenloom.tasks.translation import translate
    from tokenloom.training import load_run_config
    from tokenloom.training.setup import setup_run

    _write_pairs(tmp_path)
    recipe = {"task": "translation", "model": {**TINY, "dropout": 0.1},
              "data": {"dir": str(tmp_path), "source_lang": "xx", "target_lang": "yy", "test": [], "vocab_size": 300,
                       "max_source_len": 16, "max_target_len": 16, "max_tokens": 128, "bleu_sentences": 4},
              "train": {"max_steps": 3, "lr": 1e-2, "warmup_steps": 1, "eval_every": 3, "eval_batches": 1,
                        "checkpoint_every": 3, "precision": "fp32", "label_smoothing": 0.1}}
    trainer = setup_run(load_run_config(recipe), tmp_path / "run", show_progress=False)
    trainer.fit()
    loaded, config = load_model(tmp_path / "run")
    assert config["model"]["family"] == "rnn_seq2seq" and isinstance(loaded, RNNEncoderDecoder)
    assert loaded.lm_head.weight is loaded.tgt_embed.weight and loaded.proj.weight.shape == (16, 24)  # tied, projected
    src, mask = sources([5, 3], vocab_size=loaded.config.vocab_size)
    tgt = target(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(loaded(src, tgt, mask), trainer.model.eval()(src, tgt, mask), atol=0, rtol=0)
    sentences = ["red dog runs", "blue cat"]
    got = translate(loaded, trainer.tokenizer, sentences, beam=3)
    assert got == translate(trainer.model, trainer.tokenizer, sentences, beam=3) and len(got) == 2


# ---- config, sizes, recipe ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    ({"encoder_layers": 0}, r"^encoder_layers must be a positive integer, got 0$"),
    ({"cell": "lstmx"}, r"^cell: unknown recurrent cell 'lstmx' \(did you mean 'lstm'\?\); known: gru, lstm$"),
    ({"attention": "bilinear"}, r"^attention: unknown recurrent attention 'bilinear'.*; known: concat, dot, general$"),
    ({"vocab_size": 50, "pad_id": 50}, r"^pad_id=50 is outside the vocabulary \[0, 50\)$"),
    ({"hidden_dim": 255}, r"^hidden_dim must be even with bidirectional: true .* got 255$"),
    ({"bridge": "mlp"}, r"^bridge: unknown bridge 'mlp'.*known: linear, zeros$"),
])
def test_bad_configs_are_one_line_errors_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message) as err:
        RNNSeq2SeqConfig(**fields)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^model\.") as err:
        model_config_from_dict({"family": "rnn_seq2seq", **fields})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fields", [{}, {"cell": "gru", "attention": "concat", "tie_embeddings": False,
                                         "share_embeddings": False, "bidirectional": False, "encoder_layers": 3},
                                    {"embed_dim": 128, "hidden_dim": 384, "num_layers": 3, "bridge": "zeros"}])
def test_the_memory_estimate_is_a_close_lower_bound(fields):
    from tokenloom.models.sizes import parameter_count

    config = RNNSeq2SeqConfig(**fields)
    with torch.device("meta"):
        params = RNNEncoderDecoder(config).num_params()
    assert 0.98 * params <= parameter_count(config) <= params
    from tokenloom.models.factory import create_model

    with pytest.raises(ConfigError, match=r"^model\.(num_layers|encoder_layers|hidden_dim)=.* needs about"):
        create_model("rnn_seq2seq", RNNSeq2SeqConfig(hidden_dim=2 ** 16, num_layers=64))


def test_the_recipe_is_the_transformer_recipes_size():
    from tokenloom.training import load_run_config

    sizes = {}
    for name in ("multi30k-de-en", "multi30k-de-en-lstm"):
        config = load_run_config(str(ROOT / "configs" / f"{name}.yaml"))
        family, model_config = model_config_from_dict({"vocab_size": config.data_config.vocab_size, **config.model})
        with torch.device("meta"):
            sizes[family] = sum(p.numel() for p in MODELS.get(family)[1](model_config).parameters())
    assert 0.95 < sizes["rnn_seq2seq"] / sizes["seq2seq"] < 1.05, sizes
