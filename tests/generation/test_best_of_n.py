"""Best-of-n: picks the completion the reward prefers, n=1 is plain sampling with the same seed, a reward model
scores through the batch interface, and the CLI prints the best with every score."""

from __future__ import annotations

import pytest
import torch

from tests.tasks.preference_helpers import PAIRS, make_lm_checkpoint, run, write_jsonl
from tokenloom.checkpoint import load_model, load_tokenizer
from tokenloom.data.tokenizers import Tokenizer
from tokenloom.errors import GenerationError
from tokenloom.generation import GenerationConfig, generate
from tokenloom.generation.best_of_n import best_of_n, completion_texts
from tokenloom.models.gpt import GPT, GPTConfig


def uniform_model(tokenizer: Tokenizer) -> GPT:
    """A GPT whose next-token distribution is uniform over the vocabulary (zero output layer)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, num_layers=1, num_heads=2, embed_dim=16, max_seq_len=32,
                          tie_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model.eval()


def test_best_of_n_picks_the_completion_the_reward_prefers():
    tok = Tokenizer.train_char("abcd")
    model = uniform_model(tok)
    config = GenerationConfig(max_new_tokens=1, seed=3)
    result = best_of_n(model, tok, "a", 24, config, reward=lambda prompt, completion: float(completion == "d"))
    assert result.text == "d" and result.scores[result.index] == 1.0  # (P(no "d" in 24 draws) = 0.75^24 ~ 1e-3)
    assert len(result.completions) == len(result.scores) == 24 and result.completions[result.index] == "d"
    assert result.index == result.completions.index("d")  # the first of the equal best
    # a graded reward: the best is the argmax of the scores
    config = GenerationConfig(max_new_tokens=6, seed=4)
    result = best_of_n(model, tok, "a", 8, config, reward=lambda prompt, completion: completion.count("b"))
    assert result.scores == [float(c.count("b")) for c in result.completions]
    assert result.scores[result.index] == max(result.scores)


def test_one_sample_is_plain_sampling_with_the_same_seed():
    tok = Tokenizer.train_char("abcdefgh ")
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, num_layers=1, num_heads=2, embed_dim=16, max_seq_len=32)).eval()
    config = GenerationConfig(max_new_tokens=12, seed=7, temperature=0.9, top_k=5)
    prompt = tok.encode("abc")
    plain = generate(model, torch.tensor([prompt]), config)
    expected = completion_texts(tok, plain, len(prompt), None)[0]
    result = best_of_n(model, tok, "abc", 1, config, reward=lambda p, c: 0.0)
    assert result.text == expected and len(expected) == 12
    assert torch.equal(result.sequences, plain)


def test_best_of_n_refuses_what_it_cannot_do():
    tok = Tokenizer.train_char("ab")
    model = uniform_model(tok)
    with pytest.raises(GenerationError, match="one reward"):
        best_of_n(model, tok, "a", 2, GenerationConfig(max_new_tokens=1))
    with pytest.raises(GenerationError, match="samples its candidates"):
        best_of_n(model, tok, "a", 2, GenerationConfig(max_new_tokens=1, do_sample=False), reward=lambda p, c: 0.0)
    with pytest.raises(GenerationError, match="n >= 1"):
        best_of_n(model, tok, "a", 0, GenerationConfig(max_new_tokens=1), reward=lambda p, c: 0.0)
    with pytest.raises(GenerationError, match="2 scores for 3"):
        best_of_n(model, tok, "a", 3, GenerationConfig(max_new_tokens=1), batch_reward=lambda p, c: [0.0, 1.0])


def test_the_cli_scores_with_a_reward_model(tmp_path, capsys):
    from tokenloom.cli.main import main
    from tokenloom.tasks.reward import load_scorer

    lm = make_lm_checkpoint(tmp_path / "lm")
    path = str(write_jsonl(tmp_path / "p.jsonl", PAIRS))
    run("reward", {"path": path}, tmp_path / "rm", init_from=lm, steps=2).fit()
    rm = tmp_path / "rm" / "checkpoint"
    common = ["generate", str(lm), "--max-new-tokens", "6", "--seed", "5", "--device", "cpu", "--precision", "fp32"]
    assert main([*common, "--prompt", "say ", "--best-of", "3", "--reward-model", str(rm)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("say ") and "best of 3: sample" in err
    # the same samples, scored by the reward model through the library: the printed one is the best
    model, _ = load_model(lm)
    tok = load_tokenizer(lm)
    config = GenerationConfig(max_new_tokens=6, seed=5, eos_token_id=tok.eos_id)
    result = best_of_n(model, tok, "say ", 3, config, batch_reward=load_scorer(rm))
    assert out == "say " + result.text + "\n"
    assert main([*common, "--chat", "say cat", "--best-of", "2", "--reward-model", str(rm)]) == 0
    assert "best of 2" in capsys.readouterr().err
    assert main([*common, "--best-of", "2"]) == 2
    assert "--reward-model" in capsys.readouterr().err
    assert main([*common, "--best-of", "2", "--reward-model", str(rm), "--greedy"]) == 2
    assert main([*common, "--best-of", "2", "--reward-model", str(lm)]) == 2
    assert "not a reward model" in capsys.readouterr().err
