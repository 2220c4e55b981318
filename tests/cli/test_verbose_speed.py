"""``--verbose`` speed figures of ``generate``, ``translate``, ``evaluate`` and ``serve`` on the bundled checkpoints:
the figures' lines on stderr with their fields, stdout unchanged (the text only), and the figures consistent with
what was done (new tokens == the tokens generated, acceptance == accepted / drafted, tokens/s x ms/token == 1000).
No assertion on how fast anything ran."""

import functools
import json
import re
from pathlib import Path

import pytest
import torch

from tokenloom.checkpoint import load_model, load_tokenizer
from tokenloom.cli.main import main
from tokenloom.speed import Speed, speed_line, speed_lines

REPO = Path(__file__).resolve().parents[2]
SHAKES = REPO / "checkpoints" / "shakespeare-char"
DRAFT = REPO / "checkpoints" / "shakespeare-char-draft"
DE_EN = REPO / "checkpoints" / "multi30k-de-en"
LABELS = ("load", "sentences", "prompt", "sources", "score", "decode", "speculative", "total")
FIGURE = re.compile(rf"^({'|'.join(LABELS)}): (.*)$", re.M)


def figures(err: str) -> dict[str, str]:
    """label -> text of each ``--verbose`` line on stderr; a label printed twice fails."""
    found = FIGURE.findall(err)
    labels = [label for label, _ in found]
    assert len(labels) == len(set(labels)), err
    return dict(found)


def seconds(text: str) -> float:
    """The first duration in ``text`` (``4.2 ms``, ``1.52 s``), in seconds."""
    value, unit = re.search(r"([\d,.]+) (ms|s)\b", text).groups()
    return float(value.replace(",", "")) * (1e-3 if unit == "ms" else 1)


def count(pattern: str, text: str) -> int:
    return int(re.search(pattern, text)[1].replace(",", ""))


def assert_rate_consistent(text: str, unit: str = "token") -> None:
    """``X {unit}s/s, Y ms/{unit}``: X * Y == 1000 up to the printed digits (X to 0.1, Y to 0.01)."""
    match = re.search(rf"([\d,.]+) {unit}s/s, ([\d.]+) ms/{unit}", text)
    assert match, text
    per_second, ms = float(match[1].replace(",", "")), float(match[2])
    assert abs(per_second * ms - 1000) <= 0.05 * ms + 0.005 * per_second + 0.05 * 0.005 + 1e-9, text


def assert_drafts_consistent(text: str) -> tuple[int, int]:
    accepted, drafted, rate = re.search(r"(\d+) of (\d+) drafts kept \(acceptance ([\d.]+)\)", text).groups()
    assert int(drafted) > 0 and 0 <= int(accepted) <= int(drafted)
    assert float(rate) == pytest.approx(int(accepted) / int(drafted), abs=0.005)
    return int(drafted), int(accepted)


def run(capsys, argv) -> tuple[str, str]:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


@functools.cache
def generated_tokens(prompt: str, n: int) -> int:
    """How many tokens greedy decoding of the bundled Shakespeare model produces after ``prompt`` (at most n)."""
    from tokenloom import GenerationConfig, generate

    model, _ = load_model(SHAKES)
    tokenizer = load_tokenizer(SHAKES)
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = generate(model.eval(), ids, GenerationConfig(max_new_tokens=n, do_sample=False,
                                                       eos_token_id=tokenizer.eos_id))
    return out.shape[1] - ids.shape[1]


@pytest.mark.parametrize("drafter", [(), ("--draft", DRAFT), ("--prompt-lookup", 3)],
                         ids=["plain", "draft-model", "prompt-lookup"])
def test_generate_verbose_prints_the_speed_figures_on_stderr_and_the_same_text_on_stdout(capsys, drafter):
    argv = ["generate", SHAKES, "--prompt", "ROMEO:", "--max-new-tokens", 12, "--greedy", *drafter]
    quiet_out, quiet = run(capsys, argv)
    assert not FIGURE.search(quiet)  # without --verbose: none of it
    out, err = run(capsys, [*argv, "--verbose"])
    assert out == quiet_out and not FIGURE.search(out)  # the same text on stdout, no figure there
    f = figures(err)
    assert set(f) == {"load", "prompt", "decode", "total"} | ({"speculative"} if drafter else set())
    assert count(r"^([\d,]+) tokens", f["prompt"]) == len(load_tokenizer(SHAKES).encode("ROMEO:"))
    new = count(r"^([\d,]+) new tokens", f["decode"])
    assert new == generated_tokens("ROMEO:", 12) == 12
    assert count(r"([\d,]+) after the first", f["decode"]) == new - 1
    assert_rate_consistent(f["decode"])
    first, decode, total = seconds(f["prompt"].split("after")[1]), seconds(f["decode"].split(" in ")[1]), \
        seconds(f["total"])
    assert first + decode == pytest.approx(total, abs=0.02)  # the two phases make up the whole
    if drafter:
        assert_drafts_consistent(f["speculative"])
        assert f["speculative"].startswith("draft model" if drafter[0] == "--draft" else "prompt lookup (n <= 3)")


def test_generate_verbose_with_beam_search_reports_the_best_hypothesis_tokens(capsys):
    out, err = run(capsys, ["generate", SHAKES, "--prompt", "ROMEO:", "--max-new-tokens", 8, "--beam", 2,
                            "--verbose"])
    f = figures(err)
    assert set(f) == {"load", "prompt", "decode", "total"}
    assert "(beam 2)" in f["decode"] and count(r"^([\d,]+) new tokens", f["decode"]) == 8
    assert_rate_consistent(f["decode"])
    assert out.startswith("ROMEO:") and len(out.splitlines()) >= 1


@pytest.fixture
def sources(tmp_path):
    path = tmp_path / "in.de"
    path.write_text("Zwei Hunde spielen im Schnee.\n\nEin Mann fährt Fahrrad auf der Straße.\nEine Frau liest.\n",
                    encoding="utf-8")
    return path


@pytest.mark.parametrize("extra", [("--beam", 2), ("--prompt-lookup", 3)], ids=["beam", "prompt-lookup"])
def test_translate_verbose_prints_the_speed_figures_and_counts_the_tokens_generated(capsys, monkeypatch, sources,
                                                                                    extra):
    from tokenloom.tasks import translation

    made = []
    decode = translation.BATCH_DECODINGS["encoder_decoder"]

    def counted(*args):
        outputs = decode(*args)
        made.extend(len(tokens) for tokens in outputs)
        return outputs

    argv = ["translate", DE_EN, "--input", sources, *extra]
    plain, quiet = run(capsys, argv)
    assert not FIGURE.search(quiet)
    monkeypatch.setitem(translation.BATCH_DECODINGS, "encoder_decoder", counted)
    out, err = run(capsys, [*argv, "--verbose"])
    assert out == plain and out.count("\n") == 4 and out.splitlines()[1] == ""  # the translations only
    f = figures(err)
    speculative = extra[0] == "--prompt-lookup"
    assert set(f) == {"load", "sentences", "sources", "decode", "total"} | ({"speculative"} if speculative else set())
    assert count(r"^([\d,]+) in", f["sentences"]) == 3 == len(made)  # the empty line is not translated
    assert f["sentences"].endswith("greedy)" if speculative else "beam 2)")
    tokenizer = load_tokenizer(DE_EN)
    expected_sources = sum(len(tokenizer.encode(line)) + 1 for line in sources.read_text().splitlines() if line)
    assert count(r"^([\d,]+) tokens", f["sources"]) == expected_sources  # each with its end-of-sentence token
    assert count(r"^([\d,]+) new tokens", f["decode"]) == sum(made) > 0
    assert_rate_consistent(f["decode"])
    if speculative:
        assert_drafts_consistent(f["speculative"])
        assert "speculative decoding with" not in err  # the figure once, in the block
    else:
        assert "speculative" not in err


def test_evaluate_verbose_prints_the_evaluation_pass_speed_and_keeps_stdout_one_json_line(capsys, tmp_path):
    out, err = run(capsys, ["evaluate", SHAKES, "--batches", 1, "--batch-size", 2, "--json", "--verbose"])
    result = json.loads(out)
    assert out.count("\n") == 1
    f = figures(err)
    assert set(f) == {"load", "score", "total"}
    assert count(r"^([\d,]+) tokens", f["score"]) == result["tokens"] == 2 * 256
    assert_rate_consistent(f["score"])
    (tmp_path / "s.de").write_text("Zwei Hunde spielen im Schnee.\nEine Frau liest ein Buch.\n", encoding="utf-8")
    (tmp_path / "s.en").write_text("Two dogs play in the snow.\nA woman reads a book.\n", encoding="utf-8")
    out, err = run(capsys, ["evaluate", DE_EN, "--source", tmp_path / "s.de", "--reference", tmp_path / "s.en",
                            "--beam", 1, "--json", "--verbose"])
    assert json.loads(out)["decoding"] == "greedy" and out.count("\n") == 1
    f = figures(err)
    assert set(f) == {"load", "sentences", "sources", "decode", "total"}
    assert count(r"^([\d,]+) in", f["sentences"]) == 2


def test_serve_verbose_logs_a_line_per_completion_with_the_usage_counts(capsys, monkeypatch):
    pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn) is not installed")
    pytest.importorskip("httpx", reason="the serve-test extra (httpx) is not installed")
    import uvicorn
    from fastapi.testclient import TestClient

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **_: apps.append(app))
    for verbose in (True, False):
        run(capsys, ["serve", SHAKES, "--prompt-lookup", 3, "--max-batch", 2] + ["--verbose"] * verbose)
        with TestClient(apps[-1], base_url="http://127.0.0.1") as client:
            capsys.readouterr()
            r = client.post("/v1/completions", json={"prompt": "ROMEO:\nROMEO:\nROMEO", "max_tokens": 10,
                                                     "temperature": 0})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            metrics = client.get("/metrics").text
            two = client.post("/v1/completions", json={"prompt": "JULIET:", "max_tokens": 4, "n": 2,
                                                       "temperature": 0})
            assert two.status_code == 200, two.text
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("request")]
        if not verbose:
            assert lines == []
            continue
        assert len(lines) == 3 and lines[1].startswith("request (choice ")
        parts = dict(part.split(" ", 1) for part in lines[0].split(": ", 1)[1].split(" | "))
        assert set(parts) >= {"prompt", "decode", "total"}
        assert count(r"^([\d,]+) tokens", parts["prompt"]) == usage["prompt_tokens"]
        assert count(r"^([\d,]+) new tokens", parts["decode"]) == usage["completion_tokens"] == 10
        assert "first token after" in parts["prompt"]
        assert_rate_consistent(parts["decode"])
        served = {line.split()[0]: int(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("tokenloom_draft_tokens")}
        if served["tokenloom_draft_tokens_total"]:  # the one request so far: the line has the server's counters
            assert assert_drafts_consistent(parts["speculative"]) == (
                served["tokenloom_draft_tokens_total"], served["tokenloom_draft_tokens_accepted_total"])


def test_one_formatting_function_gives_the_lines_and_the_log_line():
    speed = Speed(2.0, new_tokens=101, prompt_tokens=10, first_token_seconds=0.5, load_seconds=1.25, drafted=40,
                  accepted=30, passes=25, rows=25, emitted=100, drafter="prompt lookup (n <= 3), k = 4")
    lines = speed_lines(speed)
    assert [line.split(":")[0] for line in lines] == ["load", "prompt", "decode", "speculative", "total"]
    assert lines[1] == "prompt: 10 tokens, first token after 500.0 ms (20 tokens/s)"
    assert lines[2] == "decode: 101 new tokens, 100 after the first in 1.50 s (66.7 tokens/s, 15.00 ms/token)"
    assert "30 of 40 drafts kept (acceptance 0.75)" in lines[3] and "4.00 tokens per pass" in lines[3]
    assert lines[4] == "total: 2.00 s (50.5 new tokens/s end to end)"
    one = speed_line(speed, "request")
    assert "\n" not in one and one.startswith("request: load 1.25 s") and one.count(" | ") == len(lines) - 1
    assert speed_lines(Speed(0.0, new_tokens=0))[0] == "decode: 0 new tokens"  # nothing to divide by


def test_samples_add_up_one_first_token_each():
    speed = Speed(3.0, new_tokens=20, prompt_tokens=12, first_token_seconds=1.0, prompts=2)
    prompt, decode = speed_lines(speed)[:2]
    assert prompt == "prompt: 12 tokens (2 prompts), first tokens after 1.00 s in all (12 tokens/s)"
    assert decode.startswith("decode: 20 new tokens, 18 after the first of each of 2 prompts in 2.00 s (9.0 tokens/s")
