"""The Universal Transformer encoder-decoder (tokenloom/models/universal_seq2seq.py): the shared encoder block with
ACT per source position, padding left out of the recurrence and the ponder, the ponder cost in the translation loss,
decoding, and config errors."""

import random

import pytest
import torch
from tests.registry.helpers import assert_close

from tokenloom.errors import ConfigError
from tokenloom.models import MODELS, EncoderDecoder, UniversalEncoderDecoder, UniversalSeq2SeqConfig
from tokenloom.models.registry import decoding_of, ponders
from tokenloom.nn import Context
from tokenloom.nn.act import adaptive_computation
from tokenloom.tasks.losses import cross_entropy
from tokenloom.tasks.translation import TranslationDataConfig, TranslationTask, translate

V = 23
BIDIRECTIONAL = Context()  # a whole-source pass of the encoder block: no mask, not causal


def tiny(seed: int = 1, varied: bool = True, **kw) -> UniversalEncoderDecoder:
    """A random model with an encoder of up to 5 steps; ``varied``: a halting unit whose positions halt after
    different numbers of steps (3 to 5 here; the default initialisation halts every position after 2)."""
    torch.manual_seed(seed)
    config = dict(vocab_size=V, embed_dim=32, num_heads=2, decoder_layers=1, encoder_max_steps=5,
                  max_source_len=16, max_target_len=16, dropout=0.0)
    if varied and kw.get("act", True):
        config["halting_bias"] = 0.0
    model = UniversalEncoderDecoder(UniversalSeq2SeqConfig(**{**config, **kw})).eval()
    if varied and model.halting is not None:
        torch.nn.init.normal_(model.halting.proj.weight, std=0.3)
    return model


def sources(*lengths: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) right-padded source ids (3.. V-1, no special ids) and their 0/1 mask."""
    gen = torch.Generator().manual_seed(seed)
    S = max(lengths)
    src, mask = torch.zeros(len(lengths), S, dtype=torch.long), torch.zeros(len(lengths), S, dtype=torch.long)
    for row, n in enumerate(lengths):
        src[row, :n] = torch.randint(3, V, (n,), generator=gen)
        mask[row, :n] = 1
    return src, mask


def _steps_by_hand(model, src):
    """The shared encoder block applied step by step outside the model (an unpadded batch), halted positions frozen:
    each step's halting probabilities (M, B, S) and states (M, B, S, C)."""
    positions = torch.arange(src.shape[1])[None].expand_as(src)
    x = model.src_embed(src) * model.config.embed_dim ** 0.5  # (scale_embeddings)
    signal = model.src_position.embed(positions)
    probs, states, running = [], [], torch.ones(src.shape, dtype=torch.bool)
    total = torch.zeros(src.shape)
    for m in range(model.config.encoder_max_steps):
        y, _ = model.encoder[0](x + signal + model.timestep[m], BIDIRECTIONAL)
        p = model.halting(y)
        probs.append(p)
        states.append(y)
        x = torch.where(running[..., None], y, x)
        halts = running & (total + p >= 1 - model.config.act_eps)
        total = torch.where(running & ~halts, total + p, total)
        running = running & ~halts
    return torch.stack(probs), torch.stack(states)


def test_registered_as_a_pondering_encoder_decoder():
    model = tiny()
    assert MODELS.get("universal_seq2seq") == (UniversalSeq2SeqConfig, UniversalEncoderDecoder)
    assert decoding_of(model) == "encoder_decoder" and ponders(model) and not ponders(EncoderDecoder)
    assert len(model.encoder) == 1  # one shared block


@torch.no_grad()
def test_encoder_halting_weights_sum_to_one_and_make_the_memory():
    model = tiny()
    src, _ = sources(9, 9)
    memory, ponder = model.encode_ponder(src)
    probs, states = _steps_by_hand(model, src)
    act = adaptive_computation(probs, states, model.config.act_eps)
    torch.testing.assert_close(act.weights.sum(0), torch.ones(2, 9), atol=1e-6, rtol=0)
    assert_close(memory, model.encoder_norm(act.output), what="memory vs the weighted states")
    torch.testing.assert_close(ponder, act.ponder, atol=1e-5, rtol=0)
    assert len(set(ponder.ceil().flatten().tolist())) > 1  # the positions halt after different numbers of steps


@torch.no_grad()
@pytest.mark.parametrize("kw", [dict(encoder_max_steps=1), dict(encoder_max_steps=1, act=False)],
                         ids=["act", "no-act"])
def test_one_step_is_one_application_of_the_shared_block(kw):
    model = tiny(varied=False, **kw)
    src, _ = sources(7, 7)
    memory, ponder = model.encode_ponder(src)
    positions = torch.arange(7)[None].expand(2, 7)
    y, _ = model.encoder[0](model.src_embed(src) * model.embed_scale + model.src_position.embed(positions)
                            + model.timestep[0], BIDIRECTIONAL)
    assert_close(memory, model.encoder_norm(y), what="one step")
    torch.testing.assert_close(ponder, torch.full((2, 7), 2.0 if model.config.act else 1.0))  # ACT: N = 1, R = 1


@torch.no_grad()
def test_without_act_every_position_takes_every_step():
    model = tiny(act=False)
    assert model.halting is None and model.ponder_cost == 0.0
    src, mask = sources(6, 3)
    _, ponder = model.encode_ponder(src, mask)
    torch.testing.assert_close(ponder, mask * 5.0)


@torch.no_grad()
@pytest.mark.parametrize("act", [True, False])
def test_padded_source_batch_equals_each_sentence_alone(act):
    model = tiny(act=act)
    src, mask = sources(8, 3, 6)
    memory, ponder = model.encode_ponder(src, mask)
    assert (ponder[mask == 0] == 0).all()  # padding counts in no ponder
    if act:  # the rows halt after different numbers of steps: the batch runs on after a row alone stops
        assert len(set(ponder[mask == 1].ceil().tolist())) > 1
    target = torch.randint(3, V, (3, 5), generator=torch.Generator().manual_seed(2))
    logits = model(src, target, mask)
    for row, n in enumerate((8, 3, 6)):
        alone_memory, alone_ponder = model.encode_ponder(src[row:row + 1, :n])
        assert_close(memory[row, :n], alone_memory[0], what=f"row {row} memory")
        torch.testing.assert_close(ponder[row, :n], alone_ponder[0], atol=1e-5, rtol=0)
        assert_close(logits[row], model(src[row:row + 1, :n], target[row:row + 1])[0], what=f"row {row} logits")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("ut")
    rng = random.Random(0)
    words = "red blue green house dog cat runs sleeps".split()
    for name, n in (("train", 60), ("val", 8)):
        pairs = [rng.choices(words, k=rng.randint(2, 6)) for _ in range(n)]
        (root / f"{name}.xx").write_text("".join(" ".join(p) + "\n" for p in pairs))
        (root / f"{name}.yy").write_text("".join(" ".join(reversed(p)).upper() + "\n" for p in pairs))
    data = TranslationDataConfig(dir=str(root), source_lang="xx", target_lang="yy", test=[], vocab_size=300,
                                 max_source_len=16, max_target_len=16, max_tokens=128, bleu=False)
    torch.manual_seed(0)
    task, model, _, section = TranslationTask.setup(
        data, {"family": "universal_seq2seq", "decoder_layers": 1, "num_heads": 2, "embed_dim": 32, "dropout": 0.0,
               "encoder_max_steps": 4, "halting_bias": -1.0, "ponder_cost": 0.05},
        root, batch_size=1, seq_len=None, label_smoothing=0.1, eval_batches=None)
    assert section["family"] == "universal_seq2seq"
    return task, model


def test_translation_loss_adds_tau_times_the_mean_ponder_of_the_real_source_positions(task):
    task, model = task
    batch = task.get_batch()
    assert (batch.source_mask == 0).any()  # a padded batch: the mean must leave the padding out
    model.eval()
    loss, n = task.loss(model, batch)
    with torch.no_grad():
        logits, ponder = model.forward_ponder(batch.source, batch.target_in, batch.source_mask)
        ce = cross_entropy(logits, batch.target_out, label_smoothing=0.1, ignore_index=task.ids["pad_id"])
    real = [ponder[b, s].item() for b in range(ponder.shape[0]) for s in range(ponder.shape[1])
            if batch.source_mask[b, s]]
    assert n == batch.num_target_tokens
    assert loss.item() == pytest.approx(ce.item() + 0.05 * sum(real) / len(real), abs=1e-5)
    assert sum(real) / len(real) > 1.0
    metrics = task.evaluate(model, max_batches=1)
    assert 1.0 < metrics["val_ponder"] <= model.config.encoder_max_steps + 1


@torch.no_grad()
def test_greedy_translate_equals_the_argmax_of_teacher_forcing(task):
    task, model = task
    model.eval()
    sentences = ["red dog runs", "blue cat sleeps green house"]
    got = translate(model, task.tokenizer, sentences, beam=1, max_len_b=2)
    assert len(got) == 2 and all(isinstance(t, str) for t in got)
    ids = task.ids
    S = max(len(task.tokenizer.encode(sentence)) + 1 for sentence in sentences)  # the batch's padded source length
    for sentence, translation in zip(sentences, got, strict=True):
        memory = model.encode(torch.tensor([task.tokenizer.encode(sentence) + [ids["eos_id"]]]))
        seq = torch.tensor([[ids["bos_id"]]])
        for _ in range(min(model.config.max_target_len - 1, int(1.5 * S + 2))):  # teacher forcing, uncached
            nxt = model.decode(seq, memory)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat((seq, nxt), 1)
            if nxt.item() == ids["eos_id"]:
                break
        tokens = [t for t in seq[0, 1:].tolist() if t not in (ids["eos_id"], ids["pad_id"])]
        assert translation == task.tokenizer.decode(tokens).strip()


@pytest.mark.parametrize("fields, message", [
    (dict(encoder_max_steps=0), "encoder_max_steps must be >= 1, got 0"),
    (dict(ponder_cost=-1), r"ponder_cost \(tau\) must be >= 0, got -1"),
    (dict(act_eps=1.0), r"act_eps must be in \(0, 1\), got 1.0"),
    (dict(act_eps=0), r"act_eps must be in \(0, 1\), got 0"),
])
def test_bad_config_is_a_one_line_error(fields, message):
    with pytest.raises(ConfigError, match=message) as info:
        UniversalSeq2SeqConfig(**fields)
    assert "\n" not in str(info.value)
