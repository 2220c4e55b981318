"""lm-evaluation-harness drives ``tokenloom serve`` through its ``local-completions`` model, offline: the
multiple-choice task's per-sample log-likelihoods, is_greedy and accuracies equal tokenloom.evaluation.score_choices on
the same items, and the generation task's outputs equal offline greedy decoding cut at the stop string.

lm-eval is not a dependency (it pins its own stack: datasets, pandas, ...). Install it in a separate environment and
point the test at its command, e.g.::

    python3 -m venv ../lmeval-venv && ../lmeval-venv/bin/pip install "lm-eval[api]" transformers torch==<this torch>
    TOKENLOOM_LM_EVAL=../lmeval-venv/bin/lm_eval pytest -m slow tests/serving/test_lm_eval.py

(else an ``lm_eval`` / ``lm-eval`` on PATH is used). The run needs no network: the tasks are local
(``evals/``, written by scripts/make_shakespeare_mc.py), the tokenizer is the checkpoint's ``tokenizer.json``
(``tokenizer_backend=huggingface,tokenizer=<checkpoint dir>``: transformers reads a bare tokenizer.json), and the
Hugging Face libraries run with ``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``.

What lm-eval sends (lm_eval 0.4.x, ``LocalCompletionsAPI._create_payload``) and reads back:

* loglikelihood: ``{"model", "prompt": [[context ids + continuation ids]], "temperature": 0, "max_tokens": 1,
  "logprobs": 1, "seed", "echo": true}``; it sums ``choices[i].logprobs.token_logprobs[ctxlen:-1]`` (so the list must
  hold one entry per prompt token, the first null, then the generated token's) and calls a continuation greedy when
  every token's logprob equals ``max(top_logprobs[j].values())``;
* generate_until: ``{"model", "prompt": [[ids]], "max_tokens": 40, "temperature": 0.0, "stop": ["\\n\\n"], "seed"}``;
  it takes ``choices[i].text`` as it is (the server must cut it at the stop string).

The server runs with ``--precision fp32``: score_choices is float32, and a bf16 server differs by ~0.1 per sum.
"""

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn) is not installed")
pytest.importorskip("httpx", reason="the serve-test extra (httpx) is not installed")

from tests.serving.live import LiveServer  # noqa: E402 - after the extras are known to be there

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SHAKES = REPO / "checkpoints" / "shakespeare-char"
LIMIT_MC, LIMIT_GEN = 40, 20


def lm_eval_command() -> str | None:
    """$TOKENLOOM_LM_EVAL (the lm_eval executable of another environment), else lm_eval / lm-eval on PATH."""
    configured = os.environ.get("TOKENLOOM_LM_EVAL")
    if configured:
        return configured if Path(configured).is_file() else shutil.which(configured)
    return shutil.which("lm_eval") or shutil.which("lm-eval")


LM_EVAL = lm_eval_command()
if LM_EVAL is None:
    pytest.skip("lm-evaluation-harness not found: set TOKENLOOM_LM_EVAL to the lm_eval command of an environment "
                "with `pip install \"lm-eval[api]\" transformers`, or put lm_eval on PATH", allow_module_level=True)


@pytest.fixture(scope="module")
def server():
    s = LiveServer(SHAKES, "--precision", "fp32", "--max-batch", "8")
    yield s
    s.stop()


def run_lm_eval(server, tasks: str, limit: int, out: Path) -> None:
    model_args = ",".join([f"base_url={server.url}/v1/completions", "model=shakespeare-char",
                           "tokenizer_backend=huggingface", f"tokenizer={SHAKES}", "max_length=256",
                           "num_concurrent=8", "max_retries=1", "timeout=120"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [LM_EVAL, "--model", "local-completions", "--model_args", model_args, "--tasks", tasks,
           "--include_path", "evals", "--limit", str(limit), "--log_samples", "--output_path", str(out / "results")]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (f"lm_eval failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                                  f"{done.stderr[-6000:]}\nserver log:\n{server.log()[-3000:]}")


def samples(out: Path, task: str) -> list[dict]:
    [path] = glob.glob(str(out / "results" / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    with open(path, encoding="utf-8") as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


def results(out: Path, task: str) -> dict:
    [path] = glob.glob(str(out / "results" / "**" / "results_*.json"), recursive=True)
    with open(path, encoding="utf-8") as f:
        return json.load(f)["results"][task]


def as_bool(value) -> bool:
    return value if isinstance(value, bool) else str(value) == "True"  # the samples log them as strings


def test_multiple_choice_loglikelihoods_equal_score_choices(server, tmp_path):
    from tokenloom.checkpoint import load_model, load_tokenizer
    from tokenloom.evaluation import score_choices

    run_lm_eval(server, "shakespeare_mc", LIMIT_MC, tmp_path)
    logged = samples(tmp_path, "shakespeare_mc")
    assert [s["doc_id"] for s in logged] == list(range(LIMIT_MC))
    model, _ = load_model(SHAKES)
    ours = score_choices(model, load_tokenizer(SHAKES), [s["doc"] for s in logged], max_length=256)
    for sample, mine in zip(logged, ours, strict=True):
        lls = [float(r[0]) for r in sample["filtered_resps"]]
        greedy = [as_bool(r[1]) for r in sample["filtered_resps"]]
        assert lls == pytest.approx(mine["loglikelihoods"], abs=1e-4), sample["doc_id"]
        assert greedy == mine["is_greedy"], sample["doc_id"]
        assert (sample["acc"], sample["acc_norm"]) == (mine["acc"], mine["acc_norm"]), sample["doc_id"]
    summary = results(tmp_path, "shakespeare_mc")
    assert summary["acc,none"] == sum(r["acc"] for r in ours) / LIMIT_MC
    assert summary["acc_norm,none"] == sum(r["acc_norm"] for r in ours) / LIMIT_MC


def test_generations_equal_offline_greedy_cut_at_the_stop_string(server, offline, tmp_path):
    run_lm_eval(server, "shakespeare_gen", LIMIT_GEN, tmp_path)
    logged = samples(tmp_path, "shakespeare_gen")
    assert len(logged) == LIMIT_GEN
    for sample in logged:
        expected = offline(sample["doc"]["context"], 40).split("\n\n")[0]
        assert sample["resps"][0][0] == expected, sample["doc_id"]
