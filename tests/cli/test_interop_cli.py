"""``tokenloom export`` / ``tokenloom import hf`` and fine-tuning an imported checkpoint (``train.init_from``)."""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tokenloom.checkpoint import load_model
from tokenloom.cli.main import main

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\nAy me.\n" * 60
TRAIN = {"max_steps": 6, "batch_size": 4, "seq_len": 32, "lr": 3e-3, "warmup_steps": 2, "eval_every": 0,
         "eval_batches": 1, "checkpoint_every": 0, "precision": "fp32"}
GPT2_LIKE = {"num_layers": 2, "num_heads": 2, "embed_dim": 32, "max_seq_len": 64, "mlp": "gelu_tanh"}
LLAMA_LIKE = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "embed_dim": 32, "max_seq_len": 64,
              "position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "tie_embeddings": False}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop_cli")
    (root / "corpus.txt").write_text(TEXT)
    for name, model in (("gpt2", GPT2_LIKE), ("llama", LLAMA_LIKE)):
        recipe = {"model": model, "data": {"path": str(root / "corpus.txt")}, "train": TRAIN}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
        assert main(["train", str(root / f"{name}.yaml"), "--out", str(root / name)]) == 0
    return root


def _greedy(capsys, checkpoint) -> str:
    capsys.readouterr()
    assert main(["generate", str(checkpoint), "--prompt", "ROMEO:", "--greedy", "--max-new-tokens", "40"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name, architecture", [("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM")])
def test_export_import_round_trip(runs, tmp_path, capsys, name, architecture):
    exported, imported = tmp_path / "hf", tmp_path / "imported"
    assert main(["export", str(runs / name), "--format", "hf", "--out", str(exported)]) == 0
    assert architecture in capsys.readouterr().out
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == [architecture]
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (exported / f).is_file()
    assert main(["import", "hf", str(exported), "--out", str(imported)]) == 0
    original, _ = load_model(runs / name)
    back, cfg = load_model(imported)
    assert cfg["source"]["architecture"] == architecture
    assert back.config == original.config
    for key, tensor in original.state_dict().items():
        assert torch.equal(tensor, back.state_dict()[key]), key
    assert _greedy(capsys, imported) == _greedy(capsys, runs / name)
    # an import records no training data: evaluate asks for it, and works with it
    assert main(["evaluate", str(imported)]) == 2
    assert "pass --data FILE" in capsys.readouterr().err
    assert main(["evaluate", str(imported), "--data", str(runs / "corpus.txt"), "--batches", "1"]) == 0


def test_exported_loads_in_transformers(runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    for name in ("gpt2", "llama"):
        out = tmp_path / name
        assert main(["export", str(runs / name), "--out", str(out), "--dtype", "bfloat16"]) == 0
        assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        ours, _ = load_model(runs / name, dtype=torch.bfloat16)
        tok = transformers.AutoTokenizer.from_pretrained(out)
        ids = tok("But soft, what light", return_tensors="pt").input_ids
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-2, rtol=1e-2)


def test_fine_tune_an_imported_checkpoint(runs, tmp_path):
    exported, imported = tmp_path / "hf", tmp_path / "imported"
    assert main(["export", str(runs / "llama"), "--out", str(exported)]) == 0
    assert main(["import", "hf", str(exported), "--out", str(imported)]) == 0
    recipe = {"data": {"path": str(runs / "corpus.txt")},
              "train": {**TRAIN, "max_steps": 1, "lr": 1e-9, "warmup_steps": 0, "init_from": str(imported)}}
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(tmp_path / "ft.yaml"), "--out", str(tmp_path / "ft")]) == 0
    start, _ = load_model(imported)
    tuned, cfg = load_model(tmp_path / "ft")
    assert cfg["model"]["position"] == "rope" and cfg["model"]["num_kv_heads"] == 2  # settings came along
    for key, tensor in start.state_dict().items():  # one step at lr 1e-9: the imported weights
        torch.testing.assert_close(tuned.state_dict()[key], tensor, atol=1e-6, rtol=0)
    # the recipe may not change the architecture: a clear error
    recipe["model"] = {"num_layers": 3}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "bad")]) == 2


@pytest.mark.parametrize("args, message", [
    (["import", "hf", "{root}", "--out", "{tmp}/x"], "no config.json"),
    (["import", "hf", "{root}/nowhere", "--out", "{tmp}/x"], "not found"),
    (["import", "hf", "{tmp}/bert", "--out", "{tmp}/x"], "supported: GPT2LMHeadModel"),
    (["export", "{root}/gpt2", "--out", "{root}"], "already exists and is not empty"),
    (["export", "{root}/nowhere", "--out", "{tmp}/y"], "checkpoint not found"),
])
def test_bad_input_is_one_line(runs, tmp_path, capsys, args, message):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert", "architectures": ["BertForMaskedLM"]}')
    args = [a.format(root=runs, tmp=tmp_path) for a in args]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_import_llama_with_sentencepiece_tokenizer(tmp_path, capsys):
    """A Llama directory as the hub ships it: SentencePiece-style BPE (metaspace, byte fallback, BOS added by
    the post-processor), eos in config.json. ``tokenloom generate`` prints what transformers generates."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import SentencePieceBPETokenizer, processors

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(TEXT.split("\n"), vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                           show_progress=False)
    sp.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=sp.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
        eos_token_id=2)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path / "hf")
    sp.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    assert main(["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "tl")]) == 0
    assert yaml.safe_load((tmp_path / "tl" / "config.yaml").read_text())["tokenizer"] == {"eos_token": "</s>"}

    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = hf_tok("But soft", return_tensors="pt").input_ids
    assert ids[0, 0] == 1  # BOS from the post-processor
    out = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = hf_tok.decode(out[0, ids.shape[1]:])
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "tl"), "--prompt", "But soft", "--greedy", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    assert printed == "But soft" + expected + "\n"


def test_import_and_export_mistral_with_sliding_window(tmp_path, capsys):
    """``import hf`` of a MistralForCausalLM whose sliding_window (4) is shorter than the context: the checkpoint
    has attention_window 4 and transformers' logits; ``export`` writes it back as Mistral with the window."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, bos_token_id=None, eos_token_id=None,
        attn_implementation="eager")).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "tl")]) == 0
    model, cfg = load_model(tmp_path / "tl")
    assert cfg["model"]["attention_window"] == 4 and cfg["source"]["architecture"] == "MistralForCausalLM"
    ids = torch.randint(0, 50, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "tl"), "--out", str(tmp_path / "back")]) == 0
    assert "MistralForCausalLM" in capsys.readouterr().out
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"]) == ("mistral", 4)
