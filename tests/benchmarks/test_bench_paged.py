"""benchmarks/bench_paged.py end to end at a tiny size: every scenario runs, the texts of the two configurations
agree (its exit status), and the JSON holds the ratios the README quotes."""

from __future__ import annotations

import json

import torch

from tests.benchmarks.test_experiments import _load

bench = _load("bench_paged")


def test_bench_paged_runs_every_scenario_and_reports_its_ratios(tmp_path, monkeypatch):
    def small(seed: int = 0):  # the benchmark's model, shrunk: the scenarios are what is tested here
        torch.manual_seed(seed)
        return bench.GPT(bench.GPTConfig(vocab_size=65, num_layers=1, num_heads=2, embed_dim=32, max_seq_len=2048,
                                         position="rope", dropout=0.0)).eval()

    real = bench._attention_case
    monkeypatch.setattr(bench, "model_for_bench", small)
    monkeypatch.setattr(bench, "_attention_case", lambda G, nb: real(4, 3))
    out = tmp_path / "paged.json"
    status = bench.main(["--clients", "4", "--system", "40", "--max-tokens", "3", "--requests", "4",
                         "--budget-contexts", "1", "--prefill-tokens", "64", "--threads", "1", "--json", str(out)])
    assert status == 0
    results = json.loads(out.read_text())
    assert results["prefix"]["identical"] and results["prefix"]["on"]["cached_prompt_tokens"] > 0
    assert results["mixed"]["identical"] and results["mixed"]["concurrency_ratio"] >= 1
    assert all(row["agree"] for row in results["attention"].values())
