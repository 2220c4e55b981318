"""Hugging Face model directories in and out: file formats, tokenizers, checkpoints, and one-line errors that
name the file, tensor or setting at fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.interop.helpers import (
    DELETE,
    assert_one_line,
    assert_same_logits,
    edit_json,
    gpt2_hf,
    ids,
    llama_hf,
    randomise,
    save_hf,
)
from tokenloom.checkpoint import load_model, load_tokenizer, read_config
from tokenloom.data.tokenizers import Tokenizer
from tokenloom.errors import CheckpointError, ConfigError
from tokenloom.interop import export_hf, from_hf, import_hf
from tokenloom.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

TEXT = ("The quick brown fox jumps over the lazy dog.\nA stitch in time saves nine; 1234 5678.\n"
        "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.\n") * 8
SAMPLE = "the lazy fox sells 42 shells\nin time!"


class NotATensor:
    """Pickled into a pytorch_model.bin: unpickling it would run this module's code."""


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """Byte-level BPE with <|endoftext|> (GPT-2 style), 300 ids."""
    return Tokenizer.train_bpe(TEXT, 300)


@pytest.fixture(scope="module")
def llama_bpe() -> Tokenizer:
    """Byte-level BPE with Llama's special tokens (no <|endoftext|>): </s> is id 3."""
    tok = Tokenizer.train_bpe(TEXT, 300, special_tokens=("<unk>", "<pad>", "<s>", "</s>"))
    assert tok.backend.token_to_id("</s>") == 3 and tok.eos_id is None
    return tok


def _gpt2_dir(directory: Path, seed: int = 1, **overrides) -> tuple[torch.nn.Module, Path]:
    hf = gpt2_hf(seed=seed, **overrides)
    return hf, save_hf(hf, directory)


def _error(exc_type, fn, *args, **kwargs) -> BaseException:
    with pytest.raises(exc_type) as err:
        fn(*args, **kwargs)
    return err.value


# ---- bad directories --------------------------------------------------------------------------------

def test_directory_without_config_json(tmp_path) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    err = _error(CheckpointError, from_hf, tmp_path)
    assert_one_line(err, str(tmp_path), "config.json")
    assert_one_line(_error(CheckpointError, import_hf, tmp_path, tmp_path / "out"), "config.json")


def test_path_that_does_not_exist(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    assert_one_line(_error(CheckpointError, from_hf, missing), str(missing))
    assert_one_line(_error(CheckpointError, from_hf, str(missing)), str(missing))
    assert_one_line(_error(CheckpointError, import_hf, missing, tmp_path / "out"), str(missing))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("text", "needle"), [("{not json", "JSON"), ("[1, 2]", "object")])
def test_config_json_that_is_not_a_json_object(tmp_path, text: str, needle: str) -> None:
    (tmp_path / "config.json").write_text(text)
    assert_one_line(_error(CheckpointError, from_hf, tmp_path), "config.json", needle)


def test_directory_without_weights(tmp_path) -> None:
    _, directory = _gpt2_dir(tmp_path)
    (directory / "model.safetensors").unlink()
    assert_one_line(_error(CheckpointError, from_hf, directory), str(directory), "weights")


def test_truncated_safetensors(tmp_path) -> None:
    _, directory = _gpt2_dir(tmp_path)
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    assert_one_line(_error(CheckpointError, from_hf, directory), "model.safetensors", "corrupt")


@pytest.mark.parametrize("with_weights", [False, True])
def test_unsupported_architecture_lists_the_supported_ones(tmp_path, with_weights: bool) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    if with_weights:
        save_file({"bert.embeddings.word_embeddings.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    err = _error(ConfigError, from_hf, tmp_path)
    assert_one_line(err, "BertForMaskedLM", "GPT2LMHeadModel", "LlamaForCausalLM")
    assert_one_line(_error(ConfigError, import_hf, tmp_path, tmp_path / "out"), "BertForMaskedLM", "GPT2LMHeadModel")


# ---- weights that do not match config.json ----------------------------------------------------------

def test_shape_mismatch_from_edited_config(tmp_path) -> None:
    _, directory = _gpt2_dir(tmp_path)
    edit_json(directory / "config.json", n_embd=32)
    err = _error(CheckpointError, from_hf, directory)
    assert_one_line(err, "model.safetensors", "transformer.wte.weight", "(100, 64)", "(100, 32)")


def test_shape_mismatch_from_replaced_tensor(tmp_path) -> None:
    _, directory = _gpt2_dir(tmp_path)
    state = load_file(str(directory / "model.safetensors"))
    state["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(64, 200)
    save_file(state, str(directory / "model.safetensors"))
    err = _error(CheckpointError, from_hf, directory)
    assert_one_line(err, "transformer.h.1.mlp.c_fc.weight", "(64, 200)", "(64, 256)")


def test_shape_mismatch_in_a_concatenated_projection(tmp_path) -> None:
    """Llama's k_proj is one of three tensors fused into qkv_proj: the message names the HF tensor."""
    directory = save_hf(llama_hf(seed=2), tmp_path)  # 4 heads, 2 kv heads, head_dim 16
    state = load_file(str(directory / "model.safetensors"))
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(state, str(directory / "model.safetensors"))
    err = _error(CheckpointError, from_hf, directory)
    assert_one_line(err, "model.layers.1.self_attn.k_proj.weight", "(64, 64)", "(32, 64)")


def test_missing_tensor(tmp_path) -> None:
    _, directory = _gpt2_dir(tmp_path)
    state = load_file(str(directory / "model.safetensors"))
    del state["transformer.h.1.ln_2.bias"]
    save_file(state, str(directory / "model.safetensors"))
    err = _error(CheckpointError, from_hf, directory)
    assert_one_line(err, "model.safetensors", "missing", "transformer.h.1.ln_2.bias")


def test_unexpected_tensor(tmp_path) -> None:
    _, directory = _gpt2_dir(tmp_path)
    state = load_file(str(directory / "model.safetensors"))
    state["transformer.h.0.attn.q_norm.weight"] = torch.ones(64)
    save_file(state, str(directory / "model.safetensors"))
    err = _error(CheckpointError, from_hf, directory)
    assert_one_line(err, "model.safetensors", "unexpected", "transformer.h.0.attn.q_norm.weight")


def test_many_missing_tensors_stay_one_line(tmp_path) -> None:
    _, directory = _gpt2_dir(tmp_path)
    edit_json(directory / "config.json", n_layer=4)
    err = _error(CheckpointError, from_hf, directory)
    assert_one_line(err, "missing", "transformer.h.2.", "more")


# ---- file formats -----------------------------------------------------------------------------------

def test_pytorch_model_bin_imports(tmp_path) -> None:
    hf = gpt2_hf(seed=3, tie_word_embeddings=False)
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    model = from_hf(tmp_path)
    assert not model.config.tie_embeddings
    assert_same_logits(model, hf, ids(2, 32, seed=3))


def test_pytorch_model_bin_with_tied_copy_imports(tmp_path) -> None:
    hf = gpt2_hf(seed=3)  # its state dict holds lm_head.weight, the same tensor as wte
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    assert_same_logits(from_hf(tmp_path), hf, ids(2, 32, seed=3))


def test_pickle_that_needs_code_is_refused(tmp_path) -> None:
    hf = gpt2_hf(seed=3)
    hf.config.save_pretrained(tmp_path)
    torch.save({**hf.state_dict(), "extra": NotATensor()}, tmp_path / "pytorch_model.bin")
    err = _error(CheckpointError, from_hf, tmp_path)
    assert_one_line(err, "refusing", "pytorch_model.bin", "NotATensor")


# the legacy (pre-1.6, non-zip) torch.save format cannot be memory-mapped; weights_only=True still reads it
def test_legacy_format_pytorch_model_bin_imports(tmp_path) -> None:
    hf = gpt2_hf(seed=3)
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert_same_logits(from_hf(tmp_path), hf, ids(2, 32, seed=3))


def test_safetensors_preferred_over_pickle(tmp_path) -> None:
    hf, directory = _gpt2_dir(tmp_path, seed=4)
    torch.save({"extra": NotATensor()}, directory / "pytorch_model.bin")  # never opened
    assert_same_logits(from_hf(directory), hf, ids(2, 32, seed=4))


def _write_shards(directory: Path, state: dict[str, torch.Tensor], save, suffix: str) -> dict[str, str]:
    names = list(state)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), start=1):
        shard = f"model-0000{i}-of-00002.{suffix}"
        save({n: state[n].clone().contiguous() for n in part}, directory / shard)
        weight_map.update(dict.fromkeys(part, shard))
    return weight_map


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_sharded_checkpoint_imports(tmp_path, fmt: str) -> None:
    hf = llama_hf(seed=5)
    hf.config.save_pretrained(tmp_path)
    if fmt == "safetensors":
        weight_map = _write_shards(tmp_path, hf.state_dict(), lambda s, p: save_file(s, str(p)), "safetensors")
        index = tmp_path / "model.safetensors.index.json"
    else:
        weight_map = _write_shards(tmp_path, hf.state_dict(), torch.save, "bin")
        index = tmp_path / "pytorch_model.bin.index.json"
    total = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    assert len(set(weight_map.values())) == 2
    assert_same_logits(from_hf(tmp_path), hf, ids(2, 48, seed=5))


def test_sharded_checkpoint_with_a_missing_shard(tmp_path) -> None:
    hf = llama_hf(seed=5)
    hf.config.save_pretrained(tmp_path)
    weight_map = _write_shards(tmp_path, hf.state_dict(), lambda s, p: save_file(s, str(p)), "safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    err = _error(CheckpointError, from_hf, tmp_path)
    assert_one_line(err, "model-00002-of-00002.safetensors", "missing")


# ---- import_hf: a tokenloom checkpoint --------------------------------------------------------------

def test_import_hf_writes_a_checkpoint(tmp_path, bpe: Tokenizer) -> None:
    hf, directory = _gpt2_dir(tmp_path / "hf", seed=6, vocab_size=320)
    bpe.save(directory / "tokenizer.json")
    out = import_hf(directory, tmp_path / "ckpt")
    assert {p.name for p in out.iterdir()} == {"config.yaml", "model.safetensors", "tokenizer.json", "checksums.json"}
    model, config = load_model(out)
    assert config["source"]["architecture"] == "GPT2LMHeadModel"
    assert model.config == from_hf(directory).config
    assert_same_logits(model, hf, ids(2, 32, vocab=320, seed=6))
    tok = load_tokenizer(out)
    assert tok.encode(SAMPLE) == bpe.encode(SAMPLE) and tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert tok.eos_id == bpe.eos_id == bpe.backend.token_to_id("<|endoftext|>")


@pytest.mark.parametrize("source", ["tokenizer_config", "tokenizer_config-dict", "config-eos_token_id"])
def test_import_hf_llama_eos_token(tmp_path, llama_bpe: Tokenizer, source: str) -> None:
    hf = llama_hf(seed=7, vocab_size=320, num_hidden_layers=1)
    directory = save_hf(hf, tmp_path / "hf")
    llama_bpe.save(directory / "tokenizer.json")
    if source == "config-eos_token_id":
        edit_json(directory / "config.json", eos_token_id=3, bos_token_id=2)
    else:
        edit_json(directory / "config.json", eos_token_id=DELETE, bos_token_id=DELETE)
        eos = "</s>" if source == "tokenizer_config" else {"content": "</s>", "special": True, "lstrip": False}
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "bos_token": "<s>"}))
    out = import_hf(directory, tmp_path / "ckpt")
    tok = load_tokenizer(out)
    assert tok.eos_id == 3 and tok.eos_token == "</s>"
    assert tok.encode(SAMPLE) == llama_bpe.encode(SAMPLE)
    assert read_config(out)["tokenizer"]["eos_token"] == "</s>"
    model, _ = load_model(out)
    assert_same_logits(model, hf, ids(2, 32, vocab=320, seed=7))


def test_import_hf_without_tokenizer(tmp_path) -> None:
    hf, directory = _gpt2_dir(tmp_path / "hf", seed=8)
    out = import_hf(directory, tmp_path / "ckpt")
    assert {p.name for p in out.iterdir()} == {"config.yaml", "model.safetensors", "checksums.json"}
    model, _ = load_model(out)
    assert_same_logits(model, hf, ids(2, 32, seed=8))


def test_import_hf_tokenizer_larger_than_the_model(tmp_path, bpe: Tokenizer) -> None:
    _, directory = _gpt2_dir(tmp_path / "hf", seed=8)  # vocab 100
    bpe.save(directory / "tokenizer.json")
    err = _error(CheckpointError, import_hf, directory, tmp_path / "ckpt")
    assert_one_line(err, "tokenizer.json", "300", "100")
    assert not (tmp_path / "ckpt").exists()


def test_import_hf_into_a_non_empty_directory(tmp_path) -> None:
    hf, directory = _gpt2_dir(tmp_path / "hf", seed=9)
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    err = _error(CheckpointError, import_hf, directory, out)
    assert_one_line(err, str(out), "force")
    assert (out / "notes.txt").read_text() == "keep me"
    import_hf(directory, out, force=True)
    assert_same_logits(load_model(out)[0], hf, ids(2, 32, seed=9))
    # an existing checkpoint is replaced too, with force only
    _error(CheckpointError, import_hf, directory, out)
    import_hf(directory, out, force=True)
    assert (out / "config.yaml").is_file()
    (tmp_path / "empty").mkdir()
    import_hf(directory, tmp_path / "empty")  # an empty directory is fine


# force=True replaces a plain file that is in the way
@pytest.mark.parametrize("fn", ["import_hf", "export_hf"])
def test_force_onto_an_existing_file(tmp_path, fn: str) -> None:
    _, directory = _gpt2_dir(tmp_path / "hf", seed=9)
    out = tmp_path / "out"
    out.write_text("a file, not a directory")
    assert_one_line(_error(CheckpointError, import_hf, directory, out), str(out))  # without force: refused
    if fn == "import_hf":
        import_hf(directory, out, force=True)
    else:
        export_hf(from_hf(directory), out, force=True)
    assert out.is_dir() and (out / ("config.yaml" if fn == "import_hf" else "config.json")).is_file()


def test_import_hf_bf16(tmp_path) -> None:
    hf, directory = _gpt2_dir(tmp_path / "hf", seed=10)
    out = import_hf(directory, tmp_path / "ckpt", dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    model, _ = load_model(out)  # float32 by default, holding the bf16 values
    for name, tensor in from_hf(directory).state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor.to(torch.bfloat16).float()), name


# ---- export_hf: a Hugging Face directory ------------------------------------------------------------

LAYOUTS = {
    "gpt2": (dict(vocab_size=320, num_layers=2, num_heads=4, embed_dim=64, max_seq_len=64, mlp="gelu_tanh"),
             "GPT2LMHeadModel"),
    "llama-tiny": (dict(vocab_size=320, num_layers=2), "LlamaForCausalLM"),
}


def _layout_model(layout: str, seed: int) -> tuple[GPT, str]:
    fields, architecture = LAYOUTS[layout]
    config = GPTConfig.from_name("llama-tiny", **fields) if layout == "llama-tiny" else GPTConfig(**fields)
    return randomise(GPT(config).eval(), seed), architecture


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_hf_loads_in_transformers(tmp_path, bpe: Tokenizer, layout: str) -> None:
    model, architecture = _layout_model(layout, 11)
    out = export_hf(model, tmp_path / "hf", tokenizer=bpe)
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json"}
    assert json.loads((out / "config.json").read_text())["architectures"] == [architecture]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == architecture
    assert hf.config.eos_token_id == bpe.eos_id
    assert_same_logits(model, hf, ids(2, 40, vocab=320, seed=11))
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.encode(SAMPLE) == bpe.encode(SAMPLE)
    assert hf_tok.decode(bpe.encode(SAMPLE)) == SAMPLE
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == bpe.eos_id


def test_export_hf_from_a_checkpoint_directory(tmp_path, llama_bpe: Tokenizer) -> None:
    """HF dir -> import_hf -> export_hf(checkpoint dir): the tokenizer and its eos come along."""
    hf = llama_hf(seed=12, vocab_size=320, num_hidden_layers=1)
    directory = save_hf(hf, tmp_path / "hf")
    llama_bpe.save(directory / "tokenizer.json")
    edit_json(directory / "config.json", eos_token_id=3)
    ckpt = import_hf(directory, tmp_path / "ckpt")
    out = export_hf(ckpt, tmp_path / "hf2")
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert again.config.eos_token_id == 3
    assert_same_logits(again, hf, ids(2, 40, vocab=320, seed=12))
    assert transformers.AutoTokenizer.from_pretrained(out).encode(SAMPLE) == llama_bpe.encode(SAMPLE)


def test_export_hf_unexpressible_model(tmp_path) -> None:
    model = GPT(GPTConfig(vocab_size=32, num_layers=1, num_heads=2, embed_dim=16, max_seq_len=16, position="alibi"))
    err = _error(ConfigError, export_hf, model, tmp_path / "hf")
    assert_one_line(err, "GPT2LMHeadModel", "LlamaForCausalLM", "position")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def test_export_hf_into_a_non_empty_directory(tmp_path) -> None:
    model, _ = _layout_model("gpt2", 13)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("mine")
    assert_one_line(_error(CheckpointError, export_hf, model, out), str(out), "force")
    assert (out / "README.md").read_text() == "mine"
    export_hf(model, out, force=True)
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_full_round_trip_through_transformers(tmp_path, layout: str) -> None:
    """tokenloom -> export_hf -> from_pretrained -> save_pretrained -> from_hf: every tensor identical."""
    model, _ = _layout_model(layout, 14)
    export_hf(model, tmp_path / "exported")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    save_hf(hf, tmp_path / "resaved")
    back = from_hf(tmp_path / "resaved")
    assert back.config == model.config
    before, after = model.state_dict(), back.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_round_trip(tmp_path, layout: str) -> None:
    model, _ = _layout_model(layout, 15)
    out = export_hf(model, tmp_path / "hf", dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}
    assert next(model.parameters()).dtype == torch.float32  # the model itself is untouched
    back = from_hf(out)
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor.to(torch.bfloat16)), name
    assert transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16
    # the same bf16 weights on both sides, run in float32 (bf16 arithmetic differs by kernel)
    upcast = GPT(back.config).eval()
    upcast.load_state_dict({k: v.float() for k, v in back.state_dict().items()})
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert_same_logits(upcast, hf, ids(2, 24, vocab=320, seed=15))


# from_hf builds the model in the requested dtype: float32 RoPE tables are not rounded through bf16
def test_from_hf_float32_of_bf16_weights_keeps_rope_precision(tmp_path) -> None:
    model, _ = _layout_model("llama-tiny", 15)
    out = export_hf(model, tmp_path / "hf", dtype=torch.bfloat16)
    ours = from_hf(out, dtype=torch.float32)
    fresh = GPT(ours.config)
    torch.testing.assert_close(ours.position.cos, fresh.position.cos, atol=0, rtol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert_same_logits(ours, hf, ids(2, 24, vocab=320, seed=15))
