"""Text metrics over detokenized hypotheses and references (one reference per hypothesis).

Every metric is computed by its reference library with that library's default settings, so a number
printed here can be reproduced (and compared with published ones) from its signature:

* ``bleu``: sacrebleu corpus BLEU (tokenize 13a, exponential smoothing, case-sensitive).
* ``chrf``: sacrebleu corpus chrF (character order 6, word order 0, beta 2).
* ``rouge``: rouge-score ROUGE-1, ROUGE-2 and ROUGE-L F-measure, each averaged over sentences, no
  stemming; keys ``rouge1``, ``rouge2``, ``rougeL``. rouge-score's default tokenizer lowercases and
  keeps only ASCII letters and digits, so accented letters split words (``Häuser`` -> ``h user``) and
  text in a non-Latin script scores 0: use ``chrf`` for such languages.
* ``exact_match``: fraction of hypotheses equal to their reference after stripping surrounding
  whitespace (case-sensitive).
* ``accuracy``: fraction of predicted labels equal to the true labels (classification, labels as
  strings; for logits, top-k, per-class accuracy and confusion matrices see :mod:`.classification`).

All scores are on a 0-100 scale (sacrebleu's scale; ROUGE and exact match are multiplied by 100) so a
table of them is uniform::

    result = compute_metrics(["bleu", "chrf"], hypotheses, references)
    result.scores      # {"bleu": 27.4..., "chrf": 52.1...}
    result.signatures  # {"bleu": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0", ...}
    print(format_metrics(result))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata

from ..errors import ConfigError, DataError
from ..registry import Registry

# A metric scores a corpus and describes how: (hypotheses, references) -> (scores, signature).
MetricFn = Callable[[list[str], list[str]], tuple[dict[str, float], str]]

METRICS: Registry[MetricFn] = Registry("metric")


@dataclass(frozen=True)
class MetricResult:
    """Scores (0-100) keyed by output name, and one signature per requested metric, both in request order.

    One metric can give several scores (``rouge`` gives ``rouge1``, ``rouge2``, ``rougeL``), so the two
    dicts have different keys: ``scores`` by output name, ``signatures`` by metric name.
    """

    scores: dict[str, float] = field(default_factory=dict)
    signatures: dict[str, str] = field(default_factory=dict)


@METRICS.register("bleu")
def bleu(hypotheses: list[str], references: list[str]) -> tuple[dict[str, float], str]:
    """sacrebleu corpus BLEU with default settings (13a tokenization, exp smoothing)."""
    from sacrebleu.metrics import BLEU

    metric = BLEU()
    score = metric.corpus_score(hypotheses, [references])
    return {"bleu": float(score.score)}, str(metric.get_signature())


@METRICS.register("chrf")
def chrf(hypotheses: list[str], references: list[str]) -> tuple[dict[str, float], str]:
    """sacrebleu corpus chrF with default settings (char order 6, word order 0, beta 2)."""
    from sacrebleu.metrics import CHRF

    metric = CHRF()
    score = metric.corpus_score(hypotheses, [references])
    return {"chrf": float(score.score)}, str(metric.get_signature())


ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


@METRICS.register("rouge")
def rouge(hypotheses: list[str], references: list[str]) -> tuple[dict[str, float], str]:
    """rouge-score ROUGE-1/2/L F-measure, averaged over sentences, times 100; no stemming."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=False)
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for hyp, ref in zip(hypotheses, references, strict=True):
        scores = scorer.score(ref, hyp)  # (target, prediction)
        for key in ROUGE_TYPES:
            totals[key] += scores[key].fmeasure
    n = len(hypotheses)
    signature = f"rouge-score {_version('rouge-score')}, F1, no stemming"
    return {key: 100.0 * total / n for key, total in totals.items()}, signature


@METRICS.register("exact_match")
def exact_match(hypotheses: list[str], references: list[str]) -> tuple[dict[str, float], str]:
    """Percentage of hypotheses equal to their reference after stripping surrounding whitespace."""
    hits = sum(hyp.strip() == ref.strip() for hyp, ref in zip(hypotheses, references, strict=True))
    return {"exact_match": 100.0 * hits / len(hypotheses)}, "whitespace-stripped, case-sensitive"


@METRICS.register("accuracy")
def accuracy(hypotheses: list[str], references: list[str]) -> tuple[dict[str, float], str]:
    """Percentage of predicted labels equal to the true labels (classification; labels as strings)."""
    hits = sum(hyp == ref for hyp, ref in zip(hypotheses, references, strict=True))
    return {"accuracy": 100.0 * hits / len(hypotheses)}, "label accuracy, exact string match"


def compute_metrics(names: Sequence[str], hypotheses: Sequence[str], references: Sequence[str]) -> MetricResult:
    """Score ``hypotheses`` against ``references`` (the i-th reference belongs to the i-th hypothesis).

    ``names`` are metric names from :data:`METRICS` (repeats are scored once). Every score is on a
    0-100 scale. Raises :class:`~tokenloom.errors.ConfigError` for no or unknown metric names and
    :class:`~tokenloom.errors.DataError` for empty or mismatched inputs, before any metric runs.
    """
    fns = _resolve(names)
    hyps, refs = _check_texts(hypotheses, references)
    scores: dict[str, float] = {}
    signatures: dict[str, str] = {}
    for name, fn in fns.items():
        metric_scores, signatures[name] = fn(hyps, refs)
        scores.update(metric_scores)
    return MetricResult(scores=scores, signatures=signatures)


def format_metrics(result: MetricResult) -> str:
    """Aligned lines for a terminal: one per score (two decimals), then one per metric signature."""
    lines = []
    if result.scores:
        width = max(map(len, result.scores))
        lines += [f"{key:<{width}}  {value:6.2f}" for key, value in result.scores.items()]
    if result.signatures:
        width = max(map(len, result.signatures))
        lines.append("signatures:")
        lines += [f"  {name:<{width}}  {sig}" for name, sig in result.signatures.items()]
    return "\n".join(lines)


def _resolve(names: Sequence[str]) -> dict[str, MetricFn]:
    if isinstance(names, str):
        names = [names]
    if not names:
        raise ConfigError(f"no metrics requested; known: {', '.join(METRICS.names())}")
    return {name: METRICS.get(name) for name in names}  # dict: repeats collapse, order kept


def _check_texts(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[list[str], list[str]]:
    for what, texts in (("hypotheses", hypotheses), ("references", references)):
        if isinstance(texts, str):
            raise DataError(f"{what} must be a list of strings, got a single string")
    hyps, refs = list(hypotheses), list(references)
    if len(hyps) != len(refs):
        raise DataError(f"got {len(hyps)} hypotheses but {len(refs)} references; need one reference per hypothesis")
    if not hyps:
        raise DataError("no hypotheses to score (empty list)")
    for what, texts in (("hypotheses", hyps), ("references", refs)):
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise DataError(f"{what}[{i}] is {type(text).__name__}, not str")
    return hyps, refs


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"
