"""train.init_from an autoregressive teacher for the non-autoregressive and semi-autoregressive families
(tokenloom.models.transfer): the mapped tensors equal the teacher's, the fresh ones are named, the mapping
reproduces the teacher where the architectures coincide, and the bad starts are one-line errors."""

from __future__ import annotations

import random

import pytest
import torch
from test_trainer import run

from tokenloom.checkpoint import load_model
from tokenloom.errors import CheckpointError
from tokenloom.models import MODELS
from tokenloom.models.seq2seq import EncoderDecoder
from tokenloom.models.transfer import VOCABULARY_TENSORS, WeightMap, transfer_weights, weight_map

WORDS = "red blue green dog cat bird runs jumps sleeps the a big small old".split()
MODEL = {"encoder_layers": 1, "decoder_layers": 1, "num_heads": 2, "embed_dim": 32, "dropout": 0.0,
         "norm_placement": "pre", "mlp": "relu", "position": "sinusoidal"}
DATA = {"source_lang": "xx", "target_lang": "yy", "vocab_size": 300, "max_source_len": 24, "max_target_len": 24,
        "max_tokens": 256, "bleu": False, "test": []}
TRAIN = {"max_steps": 2, "lr": 3e-3, "warmup_steps": 1, "eval_every": 0, "eval_batches": 1, "checkpoint_every": 0,
         "precision": "fp32"}
# kind -> the student tensors with no teacher counterpart (name prefixes)
KINDS = {"cmlm": ("length_head.",), "nat": ("length_head.",), "ctc": (), "levenshtein": ("kind_heads.",),
         "insertion": ("kind_heads.",)}


def _corpus(root, name, n, seed):
    rng = random.Random(seed)
    pairs = [rng.choices(WORDS, k=rng.randint(2, 5)) for _ in range(n)]
    (root / f"{name}.xx").write_text("".join(" ".join(p) + "\n" for p in pairs))
    (root / f"{name}.yy").write_text("".join(" ".join(w.upper() for w in reversed(p)) + "\n" for p in pairs))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A 2-step autoregressive translation run: the checkpoint the students start from."""
    root = tmp_path_factory.mktemp("teacher")
    corpus = root / "corpus"
    corpus.mkdir()
    for name, n, seed in (("train", 60, 0), ("val", 8, 1)):
        _corpus(corpus, name, n, seed)
    run({"task": "translation", "model": MODEL, "data": {**DATA, "dir": str(corpus)}, "train": TRAIN}, root / "ar")
    return root


def _student(teacher, tmp_path, model, task="nat_translation", **train):
    data = {**DATA, "dir": str(teacher / "corpus")}
    recipe = {"task": task, "model": model, "data": data,
              "train": {**TRAIN, "init_from": str(teacher / "ar"), **train}}
    from tokenloom.training.config import load_run_config
    from tokenloom.training.setup import setup_run

    return setup_run(load_run_config(recipe, []), tmp_path / "student", show_progress=False)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_nat_student_copies_the_teachers_tensors_and_names_the_fresh_ones(teacher, tmp_path, kind):
    extra = {"ctc_upsample": 2, "max_target_len": 48} if kind == "ctc" else {}
    trainer = _student(teacher, tmp_path, {**MODEL, "family": "nat", "kind": kind, **extra})
    ar, _ = load_model(teacher / "ar")
    expected, got = ar.state_dict(), trainer.model.state_dict()
    vocab = ar.config.vocab_size
    fresh = []
    for name, tensor in got.items():
        if name in expected and name in VOCABULARY_TENSORS:
            assert tensor.shape[0] == vocab + 2  # <mask> and <blank> past the teacher's ids
            assert torch.equal(tensor[:vocab], expected[name]), name
        elif name in expected:
            assert torch.equal(tensor, expected[name]), name
        else:
            fresh.append(name)
    assert all(name.startswith(KINDS[kind]) for name in fresh) and bool(fresh) == bool(KINDS[kind])
    notice = next(n for n in trainer.notices if n.startswith("train.init_from="))
    assert "(seq2seq -> nat)" in notice and f"of {vocab + 2} rows" in notice
    assert all(name in notice for name in fresh) and ("fresh: none" in notice) == (not fresh)


def test_a_nat_student_decoding_causally_reproduces_the_teachers_logits(teacher, tmp_path):
    """The mapping, not the training: the student's encoder and decoder blocks, run with the teacher's causal mask
    on the teacher's decoder inputs, give the teacher's teacher-forced logits over the teacher's vocabulary."""
    trainer = _student(teacher, tmp_path, {**MODEL, "family": "nat", "kind": "cmlm"})
    ar, _ = load_model(teacher / "ar")
    student = trainer.model.eval()
    gen = torch.Generator().manual_seed(0)
    source = torch.randint(3, ar.config.vocab_size, (3, 7), generator=gen)
    target_in = torch.cat([torch.full((3, 1), ar.config.bos_id), torch.randint(3, 50, (3, 5), generator=gen)], 1)
    with torch.no_grad():
        want = ar(source, target_in)
        got = EncoderDecoder.forward(student, source, target_in)
    assert torch.allclose(got[..., :ar.config.vocab_size], want, atol=1e-5)


def test_a_semi_autoregressive_student_with_groups_of_one_is_the_teacher(teacher, tmp_path):
    trainer = _student(teacher, tmp_path, {**MODEL, "family": "semi_ar", "group_size": 1}, task="translation")
    ar, _ = load_model(teacher / "ar")
    gen = torch.Generator().manual_seed(1)
    source = torch.randint(3, ar.config.vocab_size, (2, 6), generator=gen)
    target_in = torch.cat([torch.full((2, 1), ar.config.bos_id), torch.randint(3, 50, (2, 4), generator=gen)], 1)
    with torch.no_grad():
        assert torch.allclose(trainer.model.eval()(source, target_in), ar(source, target_in), atol=1e-5)
    assert "fresh: none" in next(n for n in trainer.notices if n.startswith("train.init_from="))


def test_a_checkpoint_of_a_family_without_a_map_is_one_line(teacher, tmp_path):
    gpt_dir = tmp_path / "gpt"
    (tmp_path / "text.txt").write_text("abc def ghi " * 200)
    run({"model": {"num_layers": 1, "num_heads": 2, "embed_dim": 16, "max_seq_len": 16},
         "data": {"path": str(tmp_path / "text.txt")},
         "train": {"max_steps": 1, "batch_size": 2, "seq_len": 8, "eval_every": 0, "checkpoint_every": 0,
                   "precision": "fp32"}}, gpt_dir)
    data = {**DATA, "dir": str(teacher / "corpus")}
    recipe = {"task": "nat_translation", "model": {**MODEL, "family": "nat"}, "data": data,
              "train": {**TRAIN, "init_from": str(gpt_dir)}}
    from tokenloom.training.config import load_run_config
    from tokenloom.training.setup import setup_run

    with pytest.raises(CheckpointError, match=r"is a 'gpt' checkpoint; a 'nat' model starts from seq2seq "
                                               r"checkpoints only") as err:
        setup_run(load_run_config(recipe, []), tmp_path / "student", show_progress=False)
    assert "\n" not in str(err.value)


def test_a_layout_that_cannot_map_names_the_tensor(teacher, tmp_path):
    with pytest.raises(CheckpointError, match=r"has no decoder\.1\.") as err:
        _student(teacher, tmp_path, {**MODEL, "family": "nat", "kind": "cmlm", "decoder_layers": 2})
    assert "\n" not in str(err.value)


def _nat(vocab_size, embed_dim=16, **kw):
    config_cls, model_cls = MODELS.get("nat")
    return model_cls(config_cls(kind="cmlm", vocab_size=vocab_size, mask_id=vocab_size - 2, blank_id=vocab_size - 1,
                                encoder_layers=1, decoder_layers=1, embed_dim=embed_dim, num_heads=2, **kw))


def _ar(vocab_size, embed_dim=16):
    config_cls, model_cls = MODELS.get("seq2seq")
    return model_cls(config_cls(vocab_size=vocab_size, encoder_layers=1, decoder_layers=1, embed_dim=embed_dim,
                                num_heads=2))


def test_another_vocabulary_or_width_is_one_line_naming_the_tensor():
    mapping = weight_map("nat", "seq2seq", "teacher")
    student = _nat(40)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"teacher: tgt_embed\.weight has shape \(50, 16\), the model needs "
                                              r"\(40, 16\): its rows \(token ids: another vocabulary\) cannot map"):
        transfer_weights(student, _ar(50).state_dict(), mapping, "teacher")
    with pytest.raises(CheckpointError, match=r"teacher: .* has shape .*, the model needs .*: its shape cannot map"):
        transfer_weights(student, _ar(38, embed_dim=32).state_dict(), mapping, "teacher")
    assert all(torch.equal(v, before[k]) for k, v in student.state_dict().items())  # nothing written


def test_a_tensor_the_map_does_not_declare_fresh_is_refused():
    strict = WeightMap("seq2seq", vocab_rows=VOCABULARY_TENSORS)  # no fresh heads declared
    with pytest.raises(CheckpointError, match=r"teacher has no length_head\.weight"):
        transfer_weights(_nat(40), _ar(38).state_dict(), strict, "teacher")


def test_a_deeper_teachers_extra_layers_are_reported_unused():
    config_cls, model_cls = MODELS.get("seq2seq")
    deep = model_cls(config_cls(vocab_size=38, encoder_layers=1, decoder_layers=2, embed_dim=16, num_heads=2))
    result = transfer_weights(_nat(40), deep.state_dict(), weight_map("nat", "seq2seq", "t"), "t")
    assert result.unused and all(name.startswith("decoder.1.") for name in result.unused)
    assert result.rows == [(name, 38, 40) for name in _nat(40).state_dict() if name in VOCABULARY_TENSORS]
