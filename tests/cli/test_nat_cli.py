"""Non-autoregressive translation end to end on a tiny synthetic corpus: distill from an AR teacher, train CMLM
and CTC on the distilled corpus, translate, evaluate, bench translate; and the bad input."""

from __future__ import annotations

import csv
import json

import pytest
import yaml
from test_translation_cli import _corpus  # tests/cli is on sys.path (pytest's prepend import mode)

from tokenloom.cli.main import main
from tokenloom.hardware import machine

MODEL = {"encoder_layers": 1, "decoder_layers": 1, "num_heads": 2, "embed_dim": 32, "dropout": 0.0,
         "norm_placement": "pre"}
DATA = {"source_lang": "xx", "target_lang": "yy", "test": ["test"], "vocab_size": 300, "max_source_len": 32,
        "max_target_len": 32, "max_tokens": 512, "bleu_sentences": 8}
TRAIN = {"max_steps": 8, "lr": 3e-3, "warmup_steps": 2, "eval_every": 4, "eval_batches": 2, "checkpoint_every": 4,
         "precision": "fp32"}


def _recipe(root, name, task, model, data, train=None):
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"task": task, "model": model, "data": data, "train": {**TRAIN, **(train or {})}}))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nat")
    corpus = root / "corpus"
    corpus.mkdir()
    for name, n, seed in (("train", 120, 0), ("val", 12, 1), ("test", 10, 2)):
        _corpus(corpus, name, n, seed)
    ar = _recipe(root, "ar", "translation", MODEL, {**DATA, "dir": str(corpus)})
    assert main(["train", ar, "--out", str(root / "ar")]) == 0
    assert main(["distill", str(root / "ar"), "--split", "train", "--beam", "2", "--out", str(root / "distilled")]) == 0
    nat_data = {**DATA, "dir": str(root / "distilled"), "tokenizer_from": str(root / "ar"), "iterations": 2,
                "length_beam": 2}
    for kind in ("cmlm", "ctc"):
        recipe = _recipe(root, kind, "nat_translation", {**MODEL, "family": "nat", "kind": kind},
                         {k: v for k, v in nat_data.items() if kind == "cmlm" or k not in ("iterations",)})
        assert main(["train", recipe, "--out", str(root / kind)]) == 0
    return root


def test_distill_is_line_aligned_with_the_source_and_copies_the_other_splits(runs):
    corpus, distilled = runs / "corpus", runs / "distilled"
    assert (distilled / "train.xx").read_text() == (corpus / "train.xx").read_text()
    hyps = (distilled / "train.yy").read_text().splitlines()
    assert len(hyps) == 120 and all(h.strip() for h in hyps)
    for name in ("val.xx", "val.yy", "test.xx", "test.yy"):
        assert (distilled / name).read_text() == (corpus / name).read_text()
    assert "beam 2" in (distilled / "README.md").read_text()


def test_nat_runs_train_with_the_teachers_vocabulary_and_report_bleu(runs):
    from tokenloom.checkpoint import load_model, load_tokenizer

    teacher = load_tokenizer(runs / "ar")
    for kind in ("cmlm", "ctc"):
        records = [json.loads(line) for line in (runs / kind / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "val_bleu" in r] == [4, 8]
        model, config = load_model(runs / kind)
        assert config["task"] == "nat_translation" and model.config.kind == kind
        assert load_tokenizer(runs / kind).vocab_size == teacher.vocab_size
        assert (model.config.mask_id, model.config.blank_id) == (teacher.vocab_size, teacher.vocab_size + 1)


def test_translate_and_evaluate_a_cmlm_run(runs, capsys, tmp_path):
    source = tmp_path / "in.xx"
    source.write_text("red dog runs\n\nthe big cat\n")
    assert main(["translate", str(runs / "cmlm"), "--input", str(source), "--iterations", "3", "--length-beam", "2",
                 "--rescore", str(runs / "ar")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[1] == ""
    assert main(["evaluate", str(runs / "cmlm"), "--split", "test", "--iterations", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["decoding"] == "2 iterations, length beam 3" and result["iterations"] == 2
    assert "bleu" in result and "chrf" in result


def test_bench_translate_writes_one_matched_table(runs, tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "translate", str(runs / "ar"), str(runs / "cmlm"), str(runs / "ctc"), "--split", "test",
                 "--limit", "6", "--latency-sentences", "2", "--batch", "4", "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "translate-bench.csv").open()))
    models = [r["model"] for r in rows]
    assert models == ["AR greedy", "AR beam 5", "CMLM 1 iteration, length beam 1", "CMLM 1 iteration, length beam 3",
                      "CMLM 4 iterations, length beam 3", "CMLM 10 iterations, length beam 3", "CTC one pass"]
    assert rows[2]["paper_gap"].startswith("~1 BLEU at 10 iterations") and rows[6]["paper_gap"].startswith("1-3")
    assert next(r for r in rows if r["model"] == "AR beam 5")["speedup_vs_ar_beam5"] == "1.0"
    assert all(float(r["latency_ms"]) > 0 and float(r["throughput"]) > 0 for r in rows)
    report = (out / "translate-bench.md").read_text()
    assert "| AR beam 5 |" in report and f"\n\nMeasured on: {machine().describe()}, " in report
    assert all(r["machine"] == machine().describe() and r["date"] for r in rows)
    assert machine().describe() in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["translate", "{ar}", "--iterations", "4"], "iterations is an option of non-autoregressive models"),
    (["translate", "{cmlm}", "--beam", "3"], "beam is an option of autoregressive models"),
    (["translate", "{ctc}", "--length-beam", "2"], "a ctc model has no length candidates"),
    (["translate", "{ctc}", "--iterations", "2"], "iterations is an option of cmlm, "),
    (["translate", "{cmlm}", "--rescore", "{ctc}"], "needs the autoregressive model"),
    (["distill", "{cmlm}", "--out", "{tmp}/d"], "distill from an autoregressive teacher"),
    (["translate", "{sat}", "--beam", "3"], "a semi-autoregressive model decodes greedily"),
    (["translate", "{levenshtein}", "--iterations", "0"], "iterations must be >= 1, got 0"),
    (["translate", "{insertion}", "--iterations", "0"], "iterations must be >= 1, got 0"),
    (["translate", "{levenshtein}", "--length-beam", "2"], "a levenshtein model has no length candidates"),
])
def test_unknown_decoding_options_are_one_line_errors(family, tmp_path, capsys, argv, needle):
    source = tmp_path / "in.xx"
    source.write_text("red dog\n")
    names = ("ar", "cmlm", "ctc", "sat", "levenshtein", "insertion")
    args = [a.format(tmp=tmp_path, **{n: family / n for n in names}) for a in argv]
    assert main(args + (["--input", str(source)] if args[0] == "translate" else [])) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_a_nat_recipe_pointed_at_a_checkpoint_of_the_wrong_kind(runs, tmp_path, capsys):
    lm = tmp_path / "lm"
    text = tmp_path / "text.txt"
    text.write_text("hello world, " * 200)
    assert main(["train", _recipe(tmp_path, "lm", "lm", {"num_layers": 1, "num_heads": 2, "embed_dim": 16},
                                  {"path": str(text), "tokenizer": "char"},
                                  {"max_steps": 2, "eval_every": 0, "checkpoint_every": 0, "seq_len": 16,
                                   "batch_size": 2}), "--out", str(lm)]) == 0
    capsys.readouterr()
    recipe = _recipe(tmp_path, "bad", "nat_translation", {**MODEL, "family": "nat", "kind": "cmlm"},
                     {**DATA, "dir": str(runs / "distilled"), "tokenizer_from": str(lm)})
    assert main(["train", recipe, "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "is a lm checkpoint; it must be a translation run" in err and len(err.strip().splitlines()) == 1
    recipe = _recipe(tmp_path, "bad2", "translation", {**MODEL, "family": "nat", "kind": "cmlm"},
                     {**DATA, "dir": str(runs / "distilled")})
    assert main(["train", recipe, "--out", str(tmp_path / "bad2")]) == 2
    assert "train it with task nat_translation" in capsys.readouterr().err


def test_ctc_pairs_whose_target_cannot_fit_are_counted_and_skipped(runs, tmp_path):
    corpus = tmp_path / "long"
    corpus.mkdir()
    for name in ("train", "val", "test"):  # targets three times as long as their sources
        (corpus / f"{name}.xx").write_text("red dog\nthe cat\nblue house\n" * 4)
        (corpus / f"{name}.yy").write_text("RED RED RED DOG DOG DOG\nTHE THE CAT CAT CAT CAT\nBLUE\n" * 4)
    recipe = _recipe(tmp_path, "ctc1", "nat_translation",
                     {**MODEL, "family": "nat", "kind": "ctc", "ctc_upsample": 1},
                     {**DATA, "dir": str(corpus), "tokenizer_from": str(runs / "ar")})
    assert main(["train", recipe, "--out", str(tmp_path / "ctc1")]) == 0
    records = [json.loads(line) for line in (tmp_path / "ctc1" / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["skipped_pairs"] for r in records if "skipped_pairs" in r]
    assert skipped and skipped[-1] > 0


# ---- the rest of the family: Levenshtein, Insertion, glancing, semi-autoregressive, deep-shallow -------------------

@pytest.fixture(scope="module")
def family(runs):
    """Beside the teacher (1+1 layers): Levenshtein, Insertion, glancing NAT and glancing CTC on the distilled
    corpus, a semi-autoregressive K = 2 model started from the teacher, and a deep-encoder / shallow-decoder AR model
    (2+1 layers)."""
    nat_data = {**DATA, "dir": str(runs / "distilled"), "tokenizer_from": str(runs / "ar")}
    for name, model, data in (("levenshtein", {"kind": "levenshtein"}, {"iterations": 3}),
                              ("insertion", {"kind": "insertion"}, {"iterations": 8}),
                              ("glat", {"kind": "nat", "glancing_ratio": 0.5}, {"length_beam": 2}),
                              ("glat-ctc", {"kind": "ctc", "glancing_ratio": 0.5}, {})):
        recipe = _recipe(runs, name, "nat_translation", {**MODEL, "family": "nat", **model}, {**nat_data, **data})
        assert main(["train", recipe, "--out", str(runs / name)]) == 0
    distilled = {**DATA, "dir": str(runs / "distilled")}
    sat = _recipe(runs, "sat", "translation", {**MODEL, "family": "semi_ar", "group_size": 2}, distilled,
                  {"init_from": str(runs / "ar")})
    assert main(["train", sat, "--out", str(runs / "sat")]) == 0
    deep = _recipe(runs, "deep", "translation", {**MODEL, "encoder_layers": 2, "decoder_layers": 1}, distilled)
    assert main(["train", deep, "--out", str(runs / "deep")]) == 0
    return runs


def test_bench_translate_puts_the_whole_family_in_one_table(family, tmp_path, capsys):
    """One run measures every model: names tell the two AR models apart by their layers, speedups are relative to
    the teacher's beam 5 and greedy, every row counts its decoder passes, and the Pareto rows are marked."""
    out = tmp_path / "bench"
    names = ["ar", "deep", "sat", "glat", "glat-ctc", "levenshtein", "insertion"]
    assert main(["bench", "translate", *[str(family / n) for n in names], "--split", "test", "--limit", "6",
                 "--latency-sentences", "2", "--batch", "4", "--out", str(out)]) == 0
    rows = {r["model"]: r for r in csv.DictReader((out / "translate-bench.csv").open())}
    assert list(rows) == ["AR 1+1 greedy", "AR 1+1 beam 5", "AR 2+1 greedy", "AR 2+1 beam 5", "SAT K=2 greedy",
                          "GLAT NAT length beam 1", "GLAT NAT length beam 3",
                          "GLAT NAT length beam 3, AR rescoring", "GLAT CTC one pass",
                          "Levenshtein 3 iterations", "Levenshtein 10 iterations", "Insertion 64 iterations"]
    beam5, greedy = rows["AR 1+1 beam 5"], rows["AR 1+1 greedy"]
    assert beam5["speedup_vs_ar_beam5"] == "1.0" and greedy["speedup_vs_ar_greedy"] == "1.0"
    assert beam5["bleu_vs_ar_beam5"] == "0.0"
    for r in rows.values():
        assert float(r["rounds"]) >= 1 and float(r["tokens"]) >= 0
        assert float(r["speedup_vs_ar_greedy"]) == pytest.approx(
            float(greedy["latency_ms"]) / float(r["latency_ms"]), abs=0.01)
    assert float(rows["GLAT NAT length beam 1"]["rounds"]) == 1.0
    gaps = {name: r["paper_gap"] for name, r in rows.items()}  # the papers' reported gaps beside the measured ones
    assert gaps["AR 1+1 beam 5"] == "" and gaps["AR 2+1 greedy"].startswith("~0 against 6+6 (deep-shallow")
    assert gaps["SAT K=2 greedy"].startswith("~1% of BLEU") and gaps["GLAT NAT length beam 1"].startswith("0.25-0.9")
    assert gaps["GLAT CTC one pass"].startswith("1-3 BLEU (GLAT-CTC") and gaps["Levenshtein 3 iterations"] == \
        "~0 (Gu et al. 2019)" and gaps["Insertion 64 iterations"].startswith("~1-2 BLEU")
    assert float(rows["Levenshtein 3 iterations"]["rounds"]) <= 3
    front = [r for r in rows.values() if r["pareto"] == "yes"]
    assert front  # no row is faster and better than a frontier row
    for r in front:
        assert not any(float(o["latency_ms"]) < float(r["latency_ms"]) and float(o["bleu"]) > float(r["bleu"])
                       for o in rows.values())
    assert "| Pareto | run |" in (out / "translate-bench.md").read_text()


@pytest.mark.parametrize("name", ["levenshtein", "insertion", "glat", "glat-ctc", "sat", "deep"])
def test_every_family_member_translates_and_keeps_empty_lines(family, tmp_path, capsys, name):
    source = tmp_path / "in.xx"
    source.write_text("red dog runs\n\nthe big cat\n")
    assert main(["translate", str(family / name), "--input", str(source)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[1] == ""


@pytest.mark.parametrize("model,data,needle", [
    ({"family": "semi_ar", "group_size": 40}, {}, "group_size must be an integer from 1 to max_target_len=32, "
                                                  "got 40"),
    ({"family": "nat", "kind": "cmlm", "glancing_ratio": 0.5}, {}, "glancing_ratio=0.5 applies to kinds"),
])
def test_family_config_errors_are_one_line(runs, tmp_path, capsys, model, data, needle):
    task = "translation" if model["family"] == "semi_ar" else "nat_translation"
    extra = {} if task == "translation" else {"tokenizer_from": str(runs / "ar")}
    recipe = _recipe(tmp_path, "bad", task, {**MODEL, **model}, {**DATA, "dir": str(runs / "distilled"), **extra})
    assert main(["train", recipe, "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_the_nat_diagnosis_separates_length_from_token_prediction(runs, capsys):
    """benchmarks/diagnose_nat.py on the tiny runs: oracle-length BLEU and token accuracy for a length-predicting
    kind, the teacher's teacher-forced accuracy beside; CTC (no length predictor) gets BLEU and rounds alone."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "diagnose_nat.py"
    spec = importlib.util.spec_from_file_location("diagnose_nat", path)
    diagnose = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diagnose)
    assert diagnose.main([str(runs / "cmlm"), "--teacher", str(runs / "ar"), "--split", "test", "--iterations", "2",
                          "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sentences"] == 10 and result["rounds_per_sentence"] == 2
    for key in ("length_exact", "token_accuracy_oracle_length", "teacher_forced_accuracy_teacher"):
        assert 0.0 <= result[key] <= 1.0
    assert result["length_mae"] >= 0 and result["bleu_oracle_length"] >= 0
    assert diagnose.main([str(runs / "ctc"), "--split", "test", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rounds_per_sentence"] == 1 and "bleu_oracle_length" not in result
    assert diagnose.main([str(runs / "ar"), "--split", "test"]) == 2
