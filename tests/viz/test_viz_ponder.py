"""tokenloom viz ponder: a pondering LM's ponder count per character as PNG and HTML, the class summary (printed and
JSON), long texts in windows, and one-line refusals."""

import html
import json
import math
import re

import pytest
import torch

from tests.viz.test_plots import assert_png
from tokenloom.checkpoint import load_model, write_checkpoint
from tokenloom.cli.main import main
from tokenloom.data.tokenizers import Tokenizer
from tokenloom.models import GPT, GPTConfig, UniversalConfig, UniversalTransformer
from tokenloom.models.factory import model_config_to_dict
from tokenloom.viz.ponder import CLASSES, ponder_summary, text_ponder, windows

# every class: letters, digits, punctuation (& < >), spaces, newlines, line starts, and "other" (the euro sign)
TEXT = "ROMEO: 2 & 3 <b>x</b>\n\nBut soft €!\nIt is"
CONTEXT = 48
LONG = TEXT * 3  # longer than the context


def _write(path, family, model, text):
    config = {"task": "lm", "model": model_config_to_dict(family, model.config), "data": {"tokenizer": "char"}}
    write_checkpoint(path, model, config, Tokenizer.train_char(text))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny Universal Transformer (characters halting after 2 to 4 steps) and a tiny GPT, as checkpoints."""
    root = tmp_path_factory.mktemp("ponder")
    torch.manual_seed(2)
    ut = UniversalTransformer(UniversalConfig(vocab_size=len(set(TEXT)), embed_dim=32, num_heads=2,
                                              max_seq_len=CONTEXT, max_steps=4, halting_bias=-1.0))
    torch.nn.init.normal_(ut.halting.proj.weight, std=0.1)
    gpt = GPT(GPTConfig(vocab_size=len(set(TEXT)), num_layers=1, num_heads=2, embed_dim=16, max_seq_len=CONTEXT))
    return _write(root / "ut", "universal", ut, TEXT), _write(root / "gpt", "gpt", gpt, TEXT)


def _by_hand(pieces: str) -> list[str]:
    """Each character's class, written out for TEXT's characters."""
    out = []
    for i, ch in enumerate(pieces):
        if ch == "\n":
            out.append("newline")
        elif i and pieces[i - 1] == "\n":
            out.append("line start")
        elif ch == " ":
            out.append("space")
        elif ch.isdigit():
            out.append("digit")
        elif ch.isalpha():
            out.append("letter")
        elif ch in ":&<>/!":
            out.append("punctuation")
        else:
            out.append("other")
    return out


def test_png_and_json_hold_the_class_summary_of_the_ponder_counts(runs, tmp_path, capsys):
    ut, _ = runs
    text = TEXT  # within the context: one forward pass gives every character's ponder count
    out, js = tmp_path / "ponder.png", tmp_path / "ponder.json"
    assert main(["viz", "ponder", str(ut), "--text", text, "--out", str(out), "--json", str(js)]) == 0
    assert_png(out)
    printed = capsys.readouterr().out
    assert all(name in printed for name in CLASSES)
    record = json.loads(js.read_text())
    assert record["unit"] == "character" and "".join(record["pieces"]) == text
    model, _ = load_model(ut)
    with torch.no_grad():
        direct = model.forward_ponder(torch.tensor([Tokenizer.train_char(TEXT).encode(text)])).ponder[0].tolist()
    assert record["ponder"] == pytest.approx(direct, abs=1e-5)
    assert len({math.ceil(v) for v in direct}) > 1  # the characters halt after different numbers of steps
    classes = record["classes"]
    assert sum(row["count"] for row in classes.values()) == record["tokens"] == len(text)
    hand = _by_hand(text)
    for name in CLASSES:
        values = [v for v, cls in zip(direct, hand, strict=True) if cls == name]
        assert classes[name]["count"] == len(values), name
        if values:
            assert classes[name]["mean_ponder"] == pytest.approx(sum(values) / len(values), abs=1e-5), name
    letter = classes["letter"]["mean_ponder"]
    assert classes["space"]["ratio_to_letter"] == pytest.approx(classes["space"]["mean_ponder"] / letter)


def test_html_holds_every_character_escaped(runs, tmp_path):
    ut, _ = runs
    out = tmp_path / "ponder.html"
    assert main(["viz", "ponder", str(ut), "--text", TEXT, "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    spans = re.findall(r'<span(?: class="nl")? style="background:#[0-9a-f]{6};color:#[0f]{3}" title="([^"]*)">(.*?)'
                       r"</span>", page, re.S)
    assert "".join(html.unescape(body) for _, body in spans) == TEXT  # one span per character, in order
    assert len(spans) == len(TEXT) and all("ponder" in html.unescape(tip) for tip, _ in spans)
    bodies = [body for _, body in spans]
    assert "&lt;" in bodies and "&amp;" in bodies and "<" not in bodies  # the text's markup is escaped


def test_a_text_longer_than_the_context_runs_in_windows_or_is_truncated_or_refused(runs, tmp_path, capsys):
    ut, _ = runs
    model, _ = load_model(ut)
    tokenizer = Tokenizer.train_char(TEXT)
    result = text_ponder(model, tokenizer, LONG)  # len(LONG) > CONTEXT: windows
    assert len(result.pieces) == len(result.ponder) == len(LONG) and len(windows(len(LONG), CONTEXT)) > 2
    ids = torch.tensor([tokenizer.encode(LONG)])
    with torch.no_grad():
        for start, end, scored in windows(len(LONG), CONTEXT):
            alone = model.forward_ponder(ids[:, start:end]).ponder[0]
            torch.testing.assert_close(result.ponder[scored:end], alone[scored - start:], atol=1e-5, rtol=0)
    summary = ponder_summary(result.pieces, result.ponder)
    assert sum(row["count"] for row in summary["classes"].values()) == len(LONG)
    js = tmp_path / "t.json"
    assert main(["viz", "ponder", str(ut), "--text", LONG, "--too-long", "truncate", "--out", str(tmp_path / "t.png"),
                 "--json", str(js)]) == 0
    assert json.loads(js.read_text())["tokens"] == CONTEXT
    _one_line(capsys, ["viz", "ponder", str(ut), "--text", LONG, "--too-long", "error", "--out",
                       str(tmp_path / "e.png")], f"longer than the model's context of {CONTEXT}")


def test_windows_score_every_token_once_with_context():
    for length, context in ((5, 8), (8, 8), (9, 8), (40, 8), (41, 7)):
        spans = windows(length, context)
        scored = [t for _, end, first in spans for t in range(first, end)]
        assert scored == list(range(length))
        for start, end, first in spans:
            assert end - start == min(context, length) and (start == 0 or first - start >= context - context // 2)


def _one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and message in err, err


def test_refusals_are_one_line(runs, tmp_path, capsys):
    ut, gpt = runs
    png = str(tmp_path / "p.png")
    _one_line(capsys, ["viz", "ponder", str(gpt), "--text", "ROMEO", "--out", png], "does not ponder")
    _one_line(capsys, ["viz", "ponder", str(ut), "--text", "ROMEO", "--out", str(tmp_path / "p.jpg")],
              "write a .png or an .html file")
    _one_line(capsys, ["viz", "ponder", str(ut), "--text-file", str(tmp_path / "missing.txt"), "--out", png],
              "no such file")
    _one_line(capsys, ["viz", "ponder", str(ut), "--out", png], "--text TEXT or --text-file FILE")
    _one_line(capsys, ["viz", "ponder", str(tmp_path / "nowhere"), "--text", "ROMEO", "--out", png], "nowhere")
