"""Several processes (torchrun's launcher, gloo on the CPU): DDP and FSDP equal one process with the global batch,
a SIGKILLed run resumes bit for bit, elastic restarts resume, FSDP checkpoints load in one process, bad input."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tokenloom.checkpoint import load_model
from tokenloom.cli.main import main
from tokenloom.errors import CheckpointError, ConfigError
from tokenloom.tasks import ImageClassificationTask, LMTask, TranslationTask
from tokenloom.training import load_run_config, setup_run
from tokenloom.training.distributed import Distributed, start
from tokenloom.training.optim import create_optimizer, load_named_optimizer_state, named_optimizer_state

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 40)


def write_recipe(tmp_path, dropout=0.0, **train):
    (tmp_path / "corpus.txt").write_text(TEXT)
    cfg = {"model": {"num_layers": 2, "num_heads": 2, "embed_dim": 32, "max_seq_len": 32, "dropout": dropout},
           "data": {"path": str(tmp_path / "corpus.txt")},
           "train": {"max_steps": 50, "batch_size": 4, "seq_len": 16, "lr": 3e-3, "warmup_steps": 5,
                     "eval_every": 25, "eval_batches": 2, "checkpoint_every": 25, "log_every": 1,
                     "precision": "fp32", **train}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def tokenloom(*args, wait=True, **kwargs):
    """``tokenloom ARGS`` in a fresh process (its own session, so a SIGKILL reaches the whole group)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom", *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, **kwargs)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def weights(run):
    return load_file(str(run / "checkpoint" / "model.safetensors"))


def without_key_bias(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` without the key part of a fused q/k/v bias. Adding a constant to every key leaves softmax
    unchanged, so that bias's true gradient is zero and what it receives is rounding noise, which AdamW turns into
    steps of about the learning rate: it differs between two runs by whatever their rounding differs by (3.5e-4
    with AVX-512 kernels, 5.5e-4 with AVX2 ones, half the tolerance below), and says nothing about equivalence."""
    if not name.endswith("attn.qkv_proj.bias"):
        return tensor
    third = tensor.shape[0] // 3  # q | k | v (these models have as many key/value heads as query heads)
    return torch.cat((tensor[:third], tensor[2 * third:]))


def last_step(run):
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.endswith("}")]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def single_2b(tmp_path_factory):
    """One process, batch 8: the reference the 2-process runs of batch 4 must equal."""
    tmp = tmp_path_factory.mktemp("single")
    code, out = tokenloom("train", write_recipe(tmp), "--out", tmp / "run", "--set", "train.batch_size=8")
    assert code == 0, out
    return tmp / "run"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_equal_one_process_with_twice_the_batch(tmp_path, single_2b, strategy):
    code, out = tokenloom("train", write_recipe(tmp_path), "--out", tmp_path / "run", "--nproc", 2,
                          "--strategy", strategy)
    assert code == 0, out
    assert f"2 processes ({strategy}, gloo)" in out
    assert out.count("checkpoint:") == 1  # rank 0 speaks
    two, one = losses(tmp_path / "run"), losses(single_2b)
    assert len(two) == len(one) == 50
    loss_gap = max(abs(a - b) for a, b in zip(two, one, strict=True))
    a, b = weights(tmp_path / "run"), weights(single_2b)
    assert a.keys() == b.keys()  # the same layout (tied weights stored once) as a single-process checkpoint
    weight_gap = max((without_key_bias(k, a[k]) - without_key_bias(k, b[k])).abs().max().item() for k in a)
    print(f"{strategy}: loss curves differ by at most {loss_gap:.2e} over 50 steps, weights by {weight_gap:.2e}")
    assert loss_gap < 1e-5
    assert weight_gap < 1e-3  # AdamW divides by sqrt(v): weights with tiny gradients amplify rounding
    if strategy == "fsdp":
        # an FSDP checkpoint loads into one process (full state dict) ...
        model = load_model(tmp_path / "run")[0]
        reference = load_model(single_2b)[0]
        x = torch.randint(0, model.config.vocab_size, (2, 16))
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), atol=1e-4, rtol=0)
        # ... and resumes there: its name-keyed optimizer state maps onto the single-process optimizer
        code, out = tokenloom("train", "--out", tmp_path / "run", "--resume", "--set", "train.max_steps=52",
                              "--set", "train.strategy=single", "--set", "train.batch_size=8")
        assert code == 0, out
        assert last_step(tmp_path / "run") == 52


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """2-process DDP, dropout on (per-rank random streams), checkpoints every 5 steps, 40 steps."""
    tmp = tmp_path_factory.mktemp("whole")
    recipe = write_recipe(tmp, dropout=0.1, max_steps=40, checkpoint_every=5, eval_every=20)
    code, out = tokenloom("train", recipe, "--out", tmp / "run", "--nproc", 2)
    assert code == 0, out
    return recipe, weights(tmp / "run")


def wait_for_step(run, proc, step, timeout=120):
    deadline = time.monotonic() + timeout
    while last_step(run) < step:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the run did not get there"
        time.sleep(0.05)


def test_sigkill_at_a_random_step_then_resume_is_bitwise_exact(tmp_path, uninterrupted):
    recipe, expected = uninterrupted
    kill_at = random.Random().randint(7, 33)
    run = tmp_path / "run"
    proc = tokenloom("train", recipe, "--out", run, "--nproc", 2, wait=False)
    wait_for_step(run, proc, kill_at)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers, mid-step or mid-checkpoint
    proc.wait()
    code, out = tokenloom("train", "--out", run, "--resume", "--nproc", 2)
    assert code == 0, f"killed at step {kill_at}: {out}"
    got = weights(run)
    assert all(torch.equal(got[k], expected[k]) for k in expected), f"killed at step {kill_at}"


def worker_pids(launcher_pid):
    """{rank: pid} of the processes torchrun's launcher started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != launcher_pid:  # the parent pid
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry.name)
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find the worker processes")
def test_elastic_restart_after_a_worker_dies_resumes_and_finishes_exactly(tmp_path, uninterrupted):
    recipe, expected = uninterrupted
    run = tmp_path / "run"
    proc = tokenloom("train", recipe, "--out", run, "--nproc", 2, "--max-restarts", 1, wait=False)
    wait_for_step(run, proc, 12)
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)  # rank 1 dies; the launcher restarts both from the checkpoint
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "restart 1: resuming" in out
    got = weights(run)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_failure_without_restarts_is_one_line_and_keeps_the_checkpoint(tmp_path):
    recipe = write_recipe(tmp_path, max_steps=400, checkpoint_every=5)
    run = tmp_path / "run"
    proc = tokenloom("train", recipe, "--out", run, "--nproc", 2, wait=False)
    wait_for_step(run, proc, 12)
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2
    assert out.strip().splitlines()[-1].startswith("error: training process 1 was killed by SIGKILL; the newest "
                                                   "intact checkpoint stays in")
    assert "Traceback" not in out
    assert (run / "checkpoint" / "model.safetensors").exists()


# -- bad input ----------------------------------------------------------------------------------------------
def test_nccl_without_a_gpu_suggests_gloo(tmp_path, capsys):
    recipe = write_recipe(tmp_path)
    assert main(["train", str(recipe), "--out", str(tmp_path / "run"), "--nproc", "2",
                 "--set", "train.backend=nccl"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nccl" in err and "train.backend=gloo" in err
    with pytest.raises(ConfigError, match="gloo"):
        start("ddp", "nccl")


def test_a_backend_for_one_process_is_checked_and_noted_not_ignored(tmp_path, capsys):
    recipe = write_recipe(tmp_path)
    assert main(["train", str(recipe), "--out", str(tmp_path / "one"), "--set", "train.backend=nccl"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.backend=nccl" in err  # nccl on a CPU: refused in one line
    assert main(["train", str(recipe), "--out", str(tmp_path / "gloo"), "--set", "train.backend=gloo",
                 "--set", "train.max_steps=2"]) == 0
    assert "note: train.backend=gloo applies to several processes" in capsys.readouterr().err


def test_strategy_single_under_torchrun_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="train.strategy=single, but torchrun started 2 processes"):
        start("single")


def test_resuming_with_another_global_batch_is_explained(tmp_path):
    recipe = write_recipe(tmp_path, max_steps=10, checkpoint_every=5, eval_every=0)
    run = tmp_path / "run"
    code, out = tokenloom("train", recipe, "--out", run, "--nproc", 2, "--set", "train.stop_after_steps=5")
    assert code == 0, out
    with pytest.raises(CheckpointError, match=r"2 process\(es\) x batch 4 x 1 .* = 8 per update, this run has 1 x 4 "
                                              r"x 1 = 4.*--set train.grad_accum_steps=2"):
        setup_run(load_run_config(str(run / "checkpoint" / "config.yaml")), run, resume=True, show_progress=False)
    # with the global batch kept, one process continues (a warning: dropout streams cannot carry over)
    config = load_run_config(str(run / "checkpoint" / "config.yaml"), ["train.grad_accum_steps=2"])
    with pytest.warns(UserWarning, match="2-process checkpoint with 1 process"):
        trainer = setup_run(config, run, resume=True, show_progress=False)
    assert trainer.step == 5 and trainer.fit()["step"] == 10


def test_config_names_the_strategy_and_backend():
    with pytest.raises(ConfigError, match="train.strategy must be one of auto, single, ddp, fsdp, got 'fdsp' "
                                          r"\(did you mean 'fsdp'\?\)"):
        load_run_config({"train": {"strategy": "fdsp"}})
    with pytest.raises(ConfigError, match="train.backend"):
        load_run_config({"train": {"backend": "mpi"}})


# -- the pieces, in one process -------------------------------------------------------------------------------
def test_lm_shards_are_slices_of_the_global_batch(tmp_path):
    config = load_run_config({"model": {"num_layers": 1, "num_heads": 2, "embed_dim": 16, "max_seq_len": 16},
                              "data": {"path": str(write_recipe(tmp_path).parent / "corpus.txt")},
                              "train": {"batch_size": 3, "seq_len": 8}})
    trainer = setup_run(config, tmp_path / "r", show_progress=False)
    task: LMTask = trainer.task
    whole = task.get_batch(torch.Generator().manual_seed(1))
    task.batch_size = 1
    parts = []
    for rank in range(3):
        task.shard(rank, 3)
        parts.append(task.get_batch(torch.Generator().manual_seed(1)))
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])


def test_image_shards_are_slices_of_the_global_batch():
    from tests.tasks.test_image_task import make_task

    from tokenloom.data.augment import AugmentConfig

    augment = AugmentConfig(crop_padding=1, rotation=5, mixup_alpha=0.2)
    one: ImageClassificationTask = make_task(augment=augment, batch_size=8)[0]
    ranks = [make_task(augment=augment, batch_size=4)[0] for _ in range(2)]
    for rank, task in enumerate(ranks):
        task.shard(rank, 2)
    for _ in range(3):
        whole = one.get_batch(torch.Generator().manual_seed(3))
        parts = [task.get_batch(torch.Generator().manual_seed(3)) for task in ranks]
        assert torch.equal(torch.cat([p.images for p in parts]), whole.images)
        assert torch.equal(torch.cat([p.targets for p in parts]), whole.targets)
    assert ranks[0].state_dict() == one.state_dict() and one.state_dict()["offset"] == 24


def parallel_corpus(root):
    rng = random.Random(0)
    words = "red blue green house dog cat runs sleeps".split()
    for name, n in (("train", 120), ("val", 10)):
        pairs = [rng.choices(words, k=rng.randint(2, 6)) for _ in range(n)]
        (root / f"{name}.xx").write_text("".join(" ".join(p) + "\n" for p in pairs))
        (root / f"{name}.yy").write_text("".join(" ".join(reversed(p)).upper() + "\n" for p in pairs))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_wrapped_losses_that_call_several_model_methods_equal_one_process(tmp_path, strategy):
    """NAT (cmlm: encoder, length head, parallel decoder) through DDP / FSDP in a group of one process: the same
    updates as without them, and evaluation (BLEU by iterative decoding) runs on the gathered weights."""
    from tokenloom.training.distributed import session

    parallel_corpus(tmp_path)
    recipe = {"task": "nat_translation",
              "model": {"family": "nat", "kind": "cmlm", "encoder_layers": 1, "decoder_layers": 1, "num_heads": 2,
                        "embed_dim": 16, "dropout": 0.0},
              "data": {"dir": str(tmp_path), "source_lang": "xx", "target_lang": "yy", "test": [], "vocab_size": 300,
                       "max_source_len": 32, "max_target_len": 32, "max_tokens": 128, "bleu_sentences": 5,
                       "iterations": 2},
              "train": {"max_steps": 4, "eval_every": 2, "eval_batches": 2, "checkpoint_every": 0, "warmup_steps": 1,
                        "precision": "fp32"}}
    finals = {}
    for name in ("single", strategy):
        config = load_run_config(recipe, [f"train.strategy={name}"])
        with session(name) as where:
            trainer = setup_run(config, tmp_path / name, show_progress=False, dist=where)
            summary = trainer.fit()
        assert "val_bleu" in summary
        finals[name] = weights(tmp_path / name), summary["val_loss"]
    (a, loss_a), (b, loss_b) = finals["single"], finals[strategy]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5 and abs(loss_a - loss_b) < 1e-5


def test_translation_ranks_take_consecutive_batches(tmp_path):
    from tokenloom.tasks.translation import TranslationDataConfig

    parallel_corpus(tmp_path)
    data = TranslationDataConfig(dir=str(tmp_path), source_lang="xx", target_lang="yy", test=[], vocab_size=300,
                                 max_source_len=32, max_target_len=32, max_tokens=128, bleu=False)
    base = TranslationTask.setup(data, {"encoder_layers": 1, "decoder_layers": 1, "num_heads": 2, "embed_dim": 16},
                                 tmp_path, batch_size=1, seq_len=None, label_smoothing=0.0, eval_batches=None)[0]
    one = TranslationTask(base.dataset, data, base.tokenizer, seed=1)
    ranks = [TranslationTask(base.dataset, data, base.tokenizer, seed=1) for _ in range(2)]
    for rank, task in enumerate(ranks):
        task.shard(rank, 2)
    per_epoch = len(one._epoch_batches())
    sequence = [one.get_batch().source for _ in range(per_epoch - per_epoch % 2)]  # the first epoch, evenly
    for step in range(len(sequence) // 2):
        for rank, task in enumerate(ranks):
            assert torch.equal(task.get_batch().source, sequence[2 * step + rank])
    assert ranks[1].state_dict() == one.state_dict()


def test_optimizer_state_by_name_round_trips():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    opt = create_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    state = named_optimizer_state(opt, names)
    assert set(state["state"]) == set(names.values())
    assert state["param_groups"][0]["params"] == ["0.weight", "2.weight"]
    fresh = create_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
    load_named_optimizer_state(fresh, state, names)
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])
    plain = create_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
    load_named_optimizer_state(plain, opt.state_dict(), names)  # older, position-keyed checkpoints still load
    assert torch.equal(plain.state[model[0].weight]["exp_avg_sq"], opt.state[model[0].weight]["exp_avg_sq"])


def test_single_process_distributed_helpers_are_no_ops():
    where = Distributed()
    assert where.all_reduce_sum([1.0, 2.0]) == [1.0, 2.0] and where.gather_objects(3) == [3]
    assert where.broadcast_object("x") == "x" and where.is_main and not where.active
