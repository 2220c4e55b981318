"""The semi-autoregressive Transformer: K = 1 is the autoregressive model, group-causal attention, cached group-by-group
decoding == one uncached forward, batch 1 == batch N, config errors, a tiny K = 2 model learns, the translation task."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from torch import Tensor

from tokenloom.errors import ConfigError
from tokenloom.generation.semi_ar import semi_ar_decode
from tokenloom.models import EncoderDecoder, Seq2SeqConfig
from tokenloom.models.factory import model_config_from_dict
from tokenloom.models.registry import decoding_of
from tokenloom.models.semi_ar import SemiARConfig, SemiAutoregressiveTransformer
from tokenloom.nn.masks import attention_mask, sequence_span
from tokenloom.tasks.losses import cross_entropy
from tokenloom.tasks.translation import translate

PAD, BOS, EOS, V = 0, 1, 2, 24
TINY = dict(vocab_size=V, encoder_layers=1, decoder_layers=2, num_heads=4, embed_dim=32, max_source_len=16,
            max_target_len=16, dropout=0.0, norm_placement="pre", tie_embeddings=False)


def make(K: int, seed: int = 0, **overrides) -> SemiAutoregressiveTransformer:
    torch.manual_seed(seed)
    return SemiAutoregressiveTransformer(SemiARConfig(**{**TINY, **overrides}, group_size=K)).eval()


def reverse_pairs(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Sources of 2..7 tokens; targets are the sources reversed, each token + 1 (ids 3..V-1)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        src = [rng.randrange(3, V - 1) for _ in range(rng.randint(2, 7))]
        pairs.append((src, [t + 1 for t in reversed(src)]))
    return pairs


def collate(pairs: list[tuple[list[int], list[int]]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> source (B, S) with EOS, its mask, target_in [BOS] y, target_out y [EOS] (B, T), right-padded."""
    S = max(len(s) for s, _ in pairs) + 1
    T = max(len(t) for _, t in pairs) + 1
    source = torch.full((len(pairs), S), PAD)
    target_in, target_out = torch.full((len(pairs), T), PAD), torch.full((len(pairs), T), PAD)
    for row, (s, t) in enumerate(pairs):
        source[row, :len(s) + 1] = torch.tensor(s + [EOS])
        target_in[row, :len(t) + 1] = torch.tensor([BOS] + t)
        target_out[row, :len(t) + 1] = torch.tensor(t + [EOS])
    return source, (source != PAD).long(), target_in, target_out


def train(model: SemiAutoregressiveTransformer, pairs, steps: int, lr: float = 3e-3) -> float:
    source, mask, target_in, target_out = collate(pairs)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = cross_entropy(model(source, target_in, mask), target_out, ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return loss.item()


@functools.cache
def trained_weights() -> dict[str, Tensor]:
    """Weights trained a little (K = 2) on reversal: greedy outputs then vary (a random model's repeat one token),
    and some sentences end early with EOS, others run to the length cap."""
    model = make(2, seed=2)
    train(model, reverse_pairs(24, seed=2), steps=30, lr=5e-3)
    return model.state_dict()


def trained(K: int) -> SemiAutoregressiveTransformer:
    """A group size K model with :func:`trained_weights` (the parameters do not depend on K)."""
    model = make(K)
    model.load_state_dict(trained_weights())
    return model


def sources(seed: int = 5) -> tuple[Tensor, Tensor]:
    """(4, S) sources of different lengths, right-padded, and their mask."""
    source, mask, _, _ = collate(reverse_pairs(4, seed))
    return source, mask


class WordTokenizer:
    """Enough of a translation tokenizer for translate(): one id per word, <pad> <s> </s> first."""

    pad_id, bos_id = PAD, BOS

    def __init__(self) -> None:
        self.vocab = ["<pad>", "<s>", "</s>", *(f"w{i}" for i in range(3, V))]
        self.vocab_size = V

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.index(token) if token in self.vocab else None

    def encode(self, text: str) -> list[int]:
        return [self.vocab.index(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.vocab[i] for i in ids)


# ---- K = 1 is the autoregressive model ------------------------------------------------------------------------

def test_group_size_one_is_the_autoregressive_model():
    """The same weights in EncoderDecoder and in a K = 1 semi-AR model: equal teacher-forced logits and identical
    greedy translations through translate(beam=1)."""
    sat = trained(1)
    ar = EncoderDecoder(Seq2SeqConfig(**TINY)).eval()
    ar.load_state_dict(sat.state_dict())
    source, mask, target_in, _ = collate(reverse_pairs(5, seed=9))
    with torch.no_grad():
        torch.testing.assert_close(sat(source, target_in, mask), ar(source, target_in, mask), rtol=0, atol=0)
    tokenizer = WordTokenizer()
    rng = random.Random(3)
    sentences = [" ".join(f"w{rng.randrange(3, V - 1)}" for _ in range(rng.randint(1, 8))) for _ in range(12)]
    for cap in (10, 2):
        from_sat = translate(sat, tokenizer, sentences, beam=1, max_len_b=cap, max_tokens=40)
        from_ar = translate(ar, tokenizer, sentences, beam=1, max_len_b=cap, max_tokens=40)
        assert from_sat == from_ar
        assert len(set(from_sat)) > 3  # translations that differ: the test can tell models apart


# ---- group-causal self-attention ------------------------------------------------------------------------------

@pytest.mark.parametrize("K", [2, 3, 4])
def test_the_mask_is_group_causal(K):
    """The one mask builder with ``group``: query i sees key j exactly when j // K <= i // K (the definition), for a
    whole sequence and for a cache holding earlier groups; K = 1 is the causal mask."""
    T = 11
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    for group, expected in ((K, j // K <= i // K), (1, j <= i)):
        mask, is_causal = attention_mask(sequence_span(T), T, causal=True, dtype=torch.float32,
                                         device=torch.device("cpu"), group=group)
        allowed = torch.ones(T, T, dtype=torch.bool).tril() if is_causal else mask
        assert torch.equal(allowed, expected)
    for past in (K, 2 * K):  # a dense cache and one new group: every key, no mask
        span = sequence_span(past + K)._replace(past=past)
        assert attention_mask(span, K, causal=True, dtype=torch.float32, device=torch.device("cpu"),
                              group=K) == (None, False)


@pytest.mark.parametrize("K", [2, 3, 4])
def test_later_groups_never_change_earlier_outputs(K):
    """Changing an input token changes no output of an earlier group, and changes the outputs of every position
    of its own group (a group's positions see each other's inputs)."""
    model = make(K)
    source, mask = sources()
    source, mask = source[:1], mask[:1]
    T = 3 * K + 1
    inputs = torch.randint(3, V, (1, T), generator=torch.Generator().manual_seed(K))
    with torch.no_grad():
        memory = model.encode(source, mask)
        base = model.decode(inputs, memory, mask)[0]  # (T, V)
        for j in range(1, T):
            changed = inputs.clone()
            changed[0, j] = 3 + (int(inputs[0, j]) - 2) % (V - 3)  # another real token
            out = model.decode(changed, memory, mask)[0]
            earlier = (j // K) * K
            torch.testing.assert_close(out[:earlier], base[:earlier], rtol=0, atol=1e-6)
            diff = (out - base).abs().amax(-1)  # (T,)
            assert bool((diff[earlier:min(earlier + K, T)] > 1e-4).all()), (j, diff)


# ---- decoding -------------------------------------------------------------------------------------------------

def positions_decoded(logits: Tensor) -> list[int]:
    """(B, n, V) decoding logits, NaN where a sentence had ended -> positions each sentence decoded."""
    return (~logits[..., 0].isnan()).sum(1).tolist()


@pytest.mark.parametrize("K", [2, 3, 4])
def test_cached_group_decoding_equals_one_uncached_forward(K):
    """The logits each cached step computes (K new positions over the cache) equal those of one uncached forward
    over the sequence decoded ([BOS] * K, then every group but the last); tokens are the argmaxes, cut at EOS."""
    model = trained(K)
    source, mask = sources()
    out = semi_ar_decode(model, source, mask, max_new_tokens=13, return_logits=True)
    lengths = positions_decoded(out.logits)
    assert any(n < out.ids.shape[1] for n in lengths) and max(lengths) == out.ids.shape[1]  # early EOS and the cap
    with torch.no_grad():
        for b, n in enumerate(lengths):
            assert n % K == 0 and out.steps[b] == n // K
            inputs = torch.cat([torch.full((K,), BOS), out.ids[b, :n - K]])[None]
            full = model.decode(inputs, model.encode(source[b:b + 1], mask[b:b + 1]), mask[b:b + 1])[0]
            torch.testing.assert_close(out.logits[b, :n], full, rtol=1e-4, atol=1e-4)
            assert torch.equal(out.ids[b, :n], full.argmax(-1))
            ids = out.ids[b, :min(n, 13)].tolist()
            assert out.tokens[b] == (ids[:ids.index(EOS)] if EOS in ids else ids)
            assert EOS not in out.ids[b, :n - K].tolist()  # a sentence ends with its first group holding EOS
            assert n == out.ids.shape[1] or EOS in out.ids[b, n - K:n].tolist()


@pytest.mark.parametrize("K", [2, 3])
def test_batch_of_one_equals_batch_of_many(K):
    """Sources of different lengths decoded together (padded) and one at a time give the same tokens and logits."""
    model = trained(K)
    source, mask = sources(seed=7)
    assert len(set(mask.sum(1).tolist())) > 1
    together = semi_ar_decode(model, source, mask, max_new_tokens=12, return_logits=True)
    for b in range(source.shape[0]):
        S = int(mask[b].sum())
        alone = semi_ar_decode(model, source[b:b + 1, :S], None, max_new_tokens=12, return_logits=True)
        assert alone.tokens[0] == together.tokens[b]
        n = positions_decoded(alone.logits)[0]
        assert n == positions_decoded(together.logits)[b]
        torch.testing.assert_close(together.logits[b, :n], alone.logits[0, :n], rtol=1e-4, atol=1e-4)


def test_a_tiny_model_learns_a_handful_of_pairs():
    """K = 2 overfits six pairs and decodes each target exactly, stopping at its EOS."""
    model = make(2, seed=1, decoder_layers=1)
    pairs = reverse_pairs(6, seed=11)
    loss = train(model, pairs, steps=80, lr=5e-3)
    assert loss < 0.02
    source, mask, _, _ = collate(pairs)
    out = semi_ar_decode(model, source, mask, max_new_tokens=14)
    assert out.tokens == [t for _, t in pairs]


# ---- configuration --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("K", [0, 17])
def test_a_group_size_outside_the_target_length_is_refused(K):
    """K > max_target_len (or < 1): one line naming the field and the value."""
    with pytest.raises(ConfigError, match=rf"group_size.*max_target_len=16, got {K}$") as err:
        model_config_from_dict({"family": "semi_ar", **TINY, "group_size": K})
    assert "\n" not in str(err.value)
    assert SemiARConfig(**TINY, group_size=16).group_size == 16


def test_family_registration_and_greedy_only():
    family, config = model_config_from_dict({"family": "semi_ar", **TINY})
    assert family == "semi_ar" and config.group_size == 2
    assert decoding_of(SemiAutoregressiveTransformer) == "semi_autoregressive"
    assert set(make(2).state_dict()) == set(EncoderDecoder(Seq2SeqConfig(**TINY)).state_dict())  # init_from works
    with pytest.raises(ConfigError, match="beam 4: a semi-autoregressive model decodes greedily"):
        translate(make(2), WordTokenizer(), ["w3 w4"], beam=4)
    assert translate(make(2), WordTokenizer(), ["w3 w4"]) == translate(make(2), WordTokenizer(), ["w3 w4"], beam=1)


# ---- the translation task -------------------------------------------------------------------------------------

def test_the_translation_task_trains_it_on_shifted_inputs(tmp_path):
    """TranslationTask.setup accepts family semi_ar; its loss is the model's cross-entropy over inputs shifted by K,
    built here from the definition (input i = target_out[i - K], the first K BOS) one sentence at a time, each up to
    the end of its last target's group: padding and the batch's width change nothing."""
    from tokenloom.tasks.translation import TranslationDataConfig, TranslationTask

    rng = random.Random(0)
    words = "red blue green house dog cat runs sleeps".split()
    for name, n in (("train", 60), ("val", 5)):
        lines = [rng.choices(words, k=rng.randint(2, 6)) for _ in range(n)]
        (tmp_path / f"{name}.xx").write_text("".join(" ".join(p) + "\n" for p in lines))
        (tmp_path / f"{name}.yy").write_text("".join(" ".join(reversed(p)).upper() + "\n" for p in lines))
    data = TranslationDataConfig(dir=str(tmp_path), source_lang="xx", target_lang="yy", test=[], vocab_size=280,
                                 max_source_len=40, max_target_len=40, max_tokens=256, bleu=False)
    task, model, _, section = TranslationTask.setup(
        data, {"family": "semi_ar", "group_size": 3, "encoder_layers": 1, "decoder_layers": 1, "num_heads": 2,
               "embed_dim": 32, "dropout": 0.0}, tmp_path, batch_size=1, seq_len=None, label_smoothing=0.0,
        eval_batches=None)
    assert section["family"] == "semi_ar" and isinstance(model, SemiAutoregressiveTransformer)
    model.eval()
    K = 3
    batch = next(task.dataset.collate(data.train, range(i, i + 6), **task.ids) for i in range(20)
                 if task.dataset.collate(data.train, range(i, i + 6), **task.ids).target_out.shape[1] % K)
    assert (batch.target_out == PAD).any() and batch.target_out.shape[1] % K  # rows of different lengths; the
    #   longest rows' last group extends past the batch's width
    with torch.no_grad():
        loss, count = task.loss(model, batch)
        memory = model.encode(batch.source, batch.source_mask)
        total = 0.0
        for b in range(batch.source.shape[0]):
            y = batch.target_out[b][batch.target_out[b] != PAD]  # y + EOS
            whole = -(-len(y) // K) * K  # the last target's group whole, as in decoding
            inputs = torch.cat([torch.full((K,), BOS), y[:-1]])[:whole][None]
            logits = model.decode(inputs, memory[b:b + 1], batch.source_mask[b:b + 1])[0, :len(y)]
            total += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
    assert count == int((batch.target_out != PAD).sum())
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
