"""A new kind of non-autoregressive model is one registration: a toy kind ``copy`` defined and registered here (no
other file edited) trains, evaluates and decodes through the normal model, task and translate API."""

from __future__ import annotations

import random

import pytest
import torch

from tokenloom.cli.translation import _label, _variants
from tokenloom.errors import ConfigError, GenerationError
from tokenloom.generation.nat import nat_decode
from tokenloom.models import NATConfig, NonAutoregressiveTransformer
from tokenloom.models.nat_kinds import NAT_KINDS, NATKind
from tokenloom.tasks.nat import NATDataConfig, NATTranslationTask
from tokenloom.tasks.translation import check_decoding_options, translate


class CopyKind(NATKind):
    """Decoder inputs: a uniform copy of the source embeddings for the predicted length (whatever
    ``decoder_input`` says); everything else the defaults: the nat loss, argmax decoding over length candidates."""

    name = "COPY"

    def decoder_inputs(self, model, source, source_mask, target_lengths=None, tokens=None):
        if target_lengths is None:
            raise GenerationError("a copy decoder needs the target lengths")
        embeds = model.scale_embeddings(model.src_embed(source))  # (B, S, C)
        positions = torch.arange(int(target_lengths.max()))
        mask = (positions[None] < target_lengths[:, None]).long()  # (B, T)
        index = (positions[None] * source_mask.sum(1)[:, None]) // target_lengths.clamp(min=1)[:, None]
        index = index.clamp(max=source.shape[1] - 1)  # (B, T): position j reads source position floor(j * S / T)
        return embeds.gather(1, index[..., None].expand(-1, -1, embeds.shape[-1])), mask


@pytest.fixture
def copy_kind(monkeypatch):
    monkeypatch.setattr(NAT_KINDS, "_items", dict(NAT_KINDS._items))  # the registration is undone after the test
    NAT_KINDS.register("copy")(CopyKind())


SOURCES = [[3, 4, 5, 2], [6, 7, 2], [8, 9, 10, 11, 2], [12, 3, 2]]
TARGETS = [[5, 4, 3], [7, 6, 6], [11, 10, 9, 8], [3, 12]]


def _padded(rows):
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    return ids, (ids != 0).long()


def _trained(kind: str, steps: int = 12):
    from tokenloom.data.parallel import ParallelBatch

    torch.manual_seed(0)
    model = NonAutoregressiveTransformer(NATConfig(
        vocab_size=16, encoder_layers=1, decoder_layers=1, num_heads=2, embed_dim=32, max_source_len=12,
        max_target_len=12, dropout=0.0, kind=kind, decoder_input="copy", mask_id=14, blank_id=15,
        max_length_offset=4))
    source, smask = _padded(SOURCES)
    target_in, tmask = _padded([[1] + t for t in TARGETS])
    batch = ParallelBatch(source, smask, target_in, target_in, tmask, int(tmask.sum()), torch.arange(4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss, _, skipped = NATTranslationTask.nat_loss(model, batch, 0.1)
        assert skipped == 0
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        decoded = nat_decode(model, source, smask, length_beam=2)
    return model, losses, decoded


def test_a_registered_kind_trains_and_decodes_like_the_kind_it_copies(copy_kind):
    """``copy`` is kind nat with ``decoder_input: copy`` written from outside: the same weights, losses and
    translations, so every place the model, the loss and the decoding consult the kind reached the new one."""
    model, losses, decoded = _trained("copy")
    _, nat_losses, nat_decoded = _trained("nat")
    assert model.length_head is not None and model.config.banned_ids == [0, 1, 2, 14, 15]
    assert losses == nat_losses and losses[-1] < losses[0]
    assert decoded == nat_decoded and len(decoded) == 4 and all(3 <= t <= 13 for row in decoded for t in row)


def test_a_registered_kind_runs_through_the_task_translate_and_bench_options(copy_kind, tmp_path):
    rng = random.Random(0)
    words = "red blue green house dog cat runs sleeps".split()
    for split, n in (("train", 60), ("val", 6)):
        pairs = [rng.choices(words, k=rng.randint(2, 4)) for _ in range(n)]
        (tmp_path / f"{split}.xx").write_text("".join(" ".join(p) + "\n" for p in pairs))
        (tmp_path / f"{split}.yy").write_text("".join(" ".join(reversed(p)).upper() + "\n" for p in pairs))
    data = NATDataConfig(dir=str(tmp_path), source_lang="xx", target_lang="yy", test=[], vocab_size=300,
                         max_source_len=16, max_target_len=16, max_tokens=256, bleu_sentences=4)
    task, model, tokenizer, section = NATTranslationTask.setup(
        data, {"kind": "copy", "encoder_layers": 1, "decoder_layers": 1, "num_heads": 2, "embed_dim": 32,
               "dropout": 0.0}, tmp_path, batch_size=1, seq_len=None, label_smoothing=0.1, eval_batches=1)
    assert section["kind"] == "copy" and model.config.kind == "copy"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(3):
        loss, count = task.loss(model, task.get_batch())
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert count > 0 and torch.isfinite(loss)
    metrics = task.evaluate(model)
    assert {"val_loss", "val_bleu"} <= set(metrics) and "skipped_pairs" not in metrics
    assert check_decoding_options(model) == {"length_beam": 3}  # the options of the default NATKind
    takers = ", ".join(k for k in NAT_KINDS if "iterations" in NAT_KINDS.get(k).options)  # cmlm, insertion, ...
    assert "cmlm" in takers
    with pytest.raises(ConfigError, match=f"^iterations is an option of {takers} models; this model is copy$"):
        check_decoding_options(model, iterations=2)
    assert len(translate(model, tokenizer, ["red dog runs", "the cat"], length_beam=2)) == 2
    assert _variants(model, can_rescore=True) == [{"length_beam": 3}]
    assert _label(model, {"length_beam": 3}) == "COPY length beam 3"
