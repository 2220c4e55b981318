"""compute_metrics against sacrebleu and rouge-score called directly, signatures, exact match, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import sacrebleu
from rouge_score import rouge_scorer
from sacrebleu.metrics import BLEU, CHRF

from tokenloom.errors import ConfigError, DataError
from tokenloom.evaluation import METRICS, MetricResult, compute_metrics, format_metrics

DATA = Path(__file__).parent / "data"
ALL = ["bleu", "chrf", "rouge", "exact_match"]


def _lines(name: str) -> list[str]:
    return (DATA / name).read_text(encoding="utf-8").splitlines()


HYPS = _lines("hyps.txt")
REFS = _lines("refs.txt")


def _rouge_reference(hyps: list[str], refs: list[str]) -> dict[str, float]:
    """Sentence-averaged F-measure x 100, one scorer per ROUGE type."""
    out = {}
    for key in ("rouge1", "rouge2", "rougeL"):
        scorer = rouge_scorer.RougeScorer([key], use_stemmer=False)
        fs = [scorer.score(ref, hyp)[key].fmeasure for hyp, ref in zip(hyps, refs, strict=True)]
        out[key] = 100.0 * sum(fs) / len(fs)
    return out


@pytest.fixture(scope="module")
def result() -> MetricResult:
    return compute_metrics(ALL, HYPS, REFS)


def test_data_files_pair_up():
    assert len(HYPS) == len(REFS) == 20
    assert HYPS[19].startswith("  ")  # the padded exact match survived reading
    assert "ä" in REFS[11] and "ö" in REFS[11] and "ü" in HYPS[11]


def test_registry_names():
    assert METRICS.names() == ["accuracy", "bleu", "chrf", "exact_match", "rouge"]


def test_bleu_and_chrf_equal_sacrebleu(result):
    bleu = sacrebleu.corpus_bleu(HYPS, [REFS]).score
    chrf = sacrebleu.corpus_chrf(HYPS, [REFS]).score
    assert result.scores["bleu"] == pytest.approx(bleu, abs=1e-9)
    assert result.scores["chrf"] == pytest.approx(chrf, abs=1e-9)
    # Non-trivial values, and the comparison tells hypotheses from references (both metrics are asymmetric).
    assert 10 < bleu < 90 and 10 < chrf < 90
    assert abs(sacrebleu.corpus_bleu(REFS, [HYPS]).score - bleu) > 1e-3
    assert abs(sacrebleu.corpus_chrf(REFS, [HYPS]).score - chrf) > 1e-3


def test_rouge_equals_rouge_score_averaged(result):
    expected = _rouge_reference(HYPS, REFS)
    for key, value in expected.items():
        assert result.scores[key] == pytest.approx(value, abs=1e-9), key
        assert 10 < value < 95, key
    # Sentence average, not a score of the concatenated corpus.
    joined = rouge_scorer.RougeScorer(["rouge2"]).score(" ".join(REFS), " ".join(HYPS))["rouge2"].fmeasure
    assert abs(100 * joined - expected["rouge2"]) > 1e-3


def test_rouge_does_not_stem():
    hyp, ref = ["the dogs were running"], ["the dog was run"]
    scores = compute_metrics(["rouge"], hyp, ref).scores
    stemmed = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True).score(ref[0], hyp[0])["rouge1"].fmeasure
    assert scores["rouge1"] == pytest.approx(25.0, abs=1e-9)  # only "the" matches
    assert 100 * stemmed > 50  # with stemming, dogs/dog and running/run would match


def test_exact_match_on_data(result):
    # Line 1 matches exactly, line 20 after stripping its leading spaces; line 14 differs only in case.
    assert result.scores["exact_match"] == pytest.approx(10.0, abs=1e-12)


def test_exact_match_strips_and_is_case_sensitive():
    scores = compute_metrics(["exact_match"], ["a", " b \n", "C", "d e"], ["a", "b", "c", "d  e"]).scores
    assert scores["exact_match"] == pytest.approx(50.0, abs=1e-12)


def test_perfect_hypotheses_score_100():
    scores = compute_metrics(ALL, REFS, REFS).scores
    assert set(scores) == {"bleu", "chrf", "rouge1", "rouge2", "rougeL", "exact_match"}
    for key, value in scores.items():
        assert value == pytest.approx(100.0, abs=1e-9), key


def test_signatures_equal_sacrebleu(result):
    bleu, chrf = BLEU(), CHRF()
    bleu.corpus_score(HYPS, [REFS])
    chrf.corpus_score(HYPS, [REFS])
    assert result.signatures["bleu"] == str(bleu.get_signature())
    assert result.signatures["bleu"] == f"nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:{sacrebleu.__version__}"
    assert result.signatures["chrf"] == str(chrf.get_signature())
    assert "nc:6|nw:0" in result.signatures["chrf"]
    from importlib.metadata import version

    assert result.signatures["rouge"] == f"rouge-score {version('rouge-score')}, F1, no stemming"
    assert list(result.signatures) == ALL


def test_order_kept_and_repeats_scored_once():
    res = compute_metrics(["rouge", "bleu", "bleu"], HYPS[:5], REFS[:5])
    assert list(res.scores) == ["rouge1", "rouge2", "rougeL", "bleu"]
    assert list(res.signatures) == ["rouge", "bleu"]


def test_format_metrics(result):
    text = format_metrics(result)
    lines = text.splitlines()
    assert lines[0] == f"bleu         {result.scores['bleu']:6.2f}"
    assert f"{result.scores['rougeL']:6.2f}" in text and " 10.00" in text
    score_lines = lines[:6]
    assert len({line.index(".") for line in score_lines}) == 1  # decimal points aligned
    assert any(line.split() == ["bleu", result.signatures["bleu"]] for line in lines[6:])
    assert "rouge-score" in text and "\n\n" not in text


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert msg and "\n" not in msg
    return msg


def test_unknown_metric_is_config_error_with_suggestion():
    with pytest.raises(ConfigError) as err:
        compute_metrics(["bleu", "rogue"], HYPS, REFS)
    msg = _one_line(err)
    assert "'rogue'" in msg and "did you mean 'rouge'" in msg
    assert "known: accuracy, bleu, chrf, exact_match, rouge" in msg


def test_unknown_metric_reported_before_data_errors():
    with pytest.raises(ConfigError):
        compute_metrics(["blue"], [], [])


def test_no_metrics_is_config_error():
    with pytest.raises(ConfigError) as err:
        compute_metrics([], HYPS, REFS)
    assert "known: accuracy, bleu" in _one_line(err)


def test_length_mismatch_is_data_error():
    with pytest.raises(DataError) as err:
        compute_metrics(["bleu"], HYPS, REFS[:17])
    msg = _one_line(err)
    assert "20 hypotheses" in msg and "17 references" in msg


@pytest.mark.parametrize("hyps, refs", [([], []), ((), ())])
def test_empty_is_data_error(hyps, refs):
    with pytest.raises(DataError) as err:
        compute_metrics(["chrf"], hyps, refs)
    assert "empty" in _one_line(err)


def test_single_string_and_non_strings_are_data_errors():
    with pytest.raises(DataError) as err:
        compute_metrics(["bleu"], "a hypothesis", "a reference")
    assert "single string" in _one_line(err)
    with pytest.raises(DataError) as err:
        compute_metrics(["bleu"], ["ok", 3], ["ok", "three"])
    assert "hypotheses[1] is int" in _one_line(err)
