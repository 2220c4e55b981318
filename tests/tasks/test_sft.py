"""The sft task: labels only on response tokens (equal to a hand-built mask), packed == unpacked loss, exact resume of
the data order, truncation, a tiny model that learns a few instructions, and the chat template recorded in the
checkpoint (trained, imported from a Hugging Face directory, exported back) and used by ``generate --chat`` and the
server's chat endpoint."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tokenloom.checkpoint import load_model, load_tokenizer
from tokenloom.cli.main import main
from tokenloom.data.chat import chat_template_for, read_conversations
from tokenloom.data.tokenizers import Tokenizer
from tokenloom.errors import ConfigError
from tokenloom.generation import GenerationConfig
from tokenloom.generation.chat import generate_reply
from tokenloom.models.gpt import GPT, GPTConfig
from tokenloom.models.rnn import RNNConfig
from tokenloom.tasks import SFTDataConfig, SFTTask
from tokenloom.tasks.sequences import IGNORE, labelled_logprobs, pack_sequences, pad_sequences, sequence_logprobs

PAIRS = [("Uppercase: king", "KING"), ("Reverse: abc", "cba"), ("Add 2 and 3", "5"), ("Uppercase: moon", "MOON"),
         ("Reverse: star", "rats"), ("Add 4 and 4", "8")]
MODEL = {"family": "gpt", "num_layers": 2, "num_heads": 2, "embed_dim": 48, "max_seq_len": 64, "position": "rope",
         "dropout": 0.0}


@pytest.fixture()
def jsonl(tmp_path):
    path = tmp_path / "sft.jsonl"
    lines = [{"prompt": p, "response": r} for p, r in PAIRS]
    lines.insert(2, {"messages": [{"role": "system", "content": "Answer."}, {"role": "user", "content": "Add 1 and 1"},
                                  {"role": "assistant", "content": "2"}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _task(jsonl, tmp_path, **data):
    config = SFTDataConfig(path=str(jsonl), val_fraction=0.3, **data)
    return SFTTask.setup(config, dict(MODEL), tmp_path / "run", batch_size=2, seq_len=None, label_smoothing=0.0,
                         eval_batches=None, seed=3)


def _gpt(vocab: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, num_layers=2, num_heads=2, embed_dim=32, max_seq_len=128)).eval()


def test_the_labels_are_exactly_the_response_tokens(jsonl, tmp_path):
    task, model, tok, _ = _task(jsonl, tmp_path, packing=False)
    chat = chat_template_for(tok, None)
    for (ids, trained), conv in zip(task.examples["train"], read_conversations(jsonl), strict=False):
        text = chat.render(conv.messages)
        assert tok.decode(ids) == text
        # hand-built: the characters after "Assistant: " up to and including the "\n\n" end
        reply = conv.messages[-1]["content"] + "\n\n"
        start = text.rindex("Assistant: ") + len("Assistant: ")
        assert text[start:] == reply
        assert trained == [False] * start + [True] * len(reply)
    batch = task._batch(task.examples["train"], [[0], [1]])
    ids, labels = batch
    for row in range(2):
        row_ids, row_trained = task.examples["train"][row]
        expected = [row_ids[t + 1] if row_trained[t + 1] else IGNORE for t in range(len(row_ids) - 1)]
        assert labels[row, :len(expected)].tolist() == expected
        assert (labels[row, len(expected):] == IGNORE).all()
    # the loss is the mean cross-entropy over exactly those positions
    logits = model(ids)
    logp = torch.log_softmax(logits.float(), -1)
    picked = [-logp[b, t, labels[b, t]] for b in range(2) for t in range(ids.shape[1]) if labels[b, t] != IGNORE]
    loss, n = task.loss(model, batch)
    assert n == len(picked)
    torch.testing.assert_close(loss, torch.stack(picked).mean())


def test_packed_and_unpacked_give_the_same_summed_loss(jsonl, tmp_path):
    task, _, tok, _ = _task(jsonl, tmp_path)
    examples = task.examples["train"]
    rows, trained = [e[0] for e in examples], [e[1] for e in examples]
    packed = pack_sequences(rows, trained, 128)
    assert len(packed.rows) < len(rows) and sum(map(len, packed.rows)) == len(rows)  # several to a row
    # the first token of an example is never a label of the one before
    for r in range(packed.ids.shape[0]):
        starts = [t for t in range(1, 128) if packed.positions[r, t] == 0 and packed.documents[r, t] != 0]
        assert all(packed.labels[r, t - 1] == IGNORE for t in starts)
    model = _gpt(tok.vocab_size)
    with torch.no_grad():
        logp_packed, n_packed = sequence_logprobs(model, packed.ids, packed.labels, documents=packed.documents)
        ids, labels, mask = pad_sequences(rows, trained, 0)
        logp_alone, n_alone = sequence_logprobs(model, ids, labels, attention_mask=mask)
    assert n_packed.sum() == n_alone.sum() == sum(sum(t[1:]) for t in trained)
    torch.testing.assert_close(logp_packed.sum(), logp_alone.sum(), rtol=1e-5, atol=1e-4)
    with torch.no_grad():  # without the document mask the packed rows would see each other: a different value
        wrong, _ = labelled_logprobs(model(packed.ids), packed.labels)
    assert not torch.allclose(wrong.sum(), logp_alone.sum(), atol=1e-3)


def test_the_data_order_resumes_exactly(jsonl, tmp_path):
    task, *_ = _task(jsonl, tmp_path)
    g = torch.Generator()
    for _ in range(3):
        task.get_batch(g)
    state = task.state_dict()
    expected = [task.get_batch(g) for _ in range(4)]
    again, *_ = _task(jsonl, tmp_path)
    again.load_state_dict(state)
    for want in expected:
        for a, b in zip(again.get_batch(g), want, strict=True):
            assert torch.equal(a, b)


def test_long_conversations_are_cut_and_counted(jsonl, tmp_path):
    # "System: Answer.\nUser: Add 1 and 1\nAssistant: " is 45 characters: nothing of its reply fits in 34
    with pytest.warns(UserWarning, match=r"^5 conversation\(s\) longer than train.seq_len=34 tokens were cut to it; "
                                         r"1 left with no response token were dropped$"):
        task, *_ = SFTTask.setup(SFTDataConfig(path=str(jsonl), val_fraction=0.3, packing=True), dict(MODEL),
                                 tmp_path / "run", batch_size=2, seq_len=34, label_smoothing=0.0, eval_batches=None)
    assert len(task.examples["train"]) == 4 and all(len(ids) <= 34 for ids, _ in task.examples["train"])


def test_packing_refuses_a_model_that_cannot_keep_examples_apart(jsonl, tmp_path):
    rnn = {"family": "rnn", "num_layers": 1, "embed_dim": 16, "hidden_dim": 16}
    assert "hidden_dim" in RNNConfig.__dataclass_fields__
    with pytest.raises(ConfigError, match="data.packing: rnn models cannot keep packed conversations apart"):
        SFTTask.setup(SFTDataConfig(path=str(jsonl)), rnn, tmp_path / "run", batch_size=2, seq_len=32,
                      label_smoothing=0.0, eval_batches=None)


def test_a_tiny_model_learns_a_few_instructions(jsonl, tmp_path):
    torch.manual_seed(0)  # (the model's initial weights)
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest (the suite's fixture sets the count back)
    task, model, tok, _ = _task(jsonl, tmp_path)
    task.examples["train"] = task.examples["train"] + task.examples["val"]  # learn them all
    rows = task._groups(task.examples["train"], range(len(task.examples["train"])))
    batch = task._batch(task.examples["train"], rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    model.train()
    for _ in range(120):
        loss, _ = task.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05
    model.eval()
    assert task.evaluate(model, max_batches=None, split="train")["train_loss"] < 0.05
    for prompt, response in PAIRS:
        reply = generate_reply(model, tok, task.template, [{"role": "user", "content": prompt}],
                               GenerationConfig(max_new_tokens=12, do_sample=False))
        assert reply == response


def _recipe(tmp_path, jsonl, **extra) -> str:
    recipe = {"task": "sft", "model": dict(MODEL), "data": {"path": str(jsonl), "val_fraction": 0.3},
              "train": {"max_steps": 3, "batch_size": 2, "seq_len": 64, "lr": 3e-3, "warmup_steps": 1, "eval_every": 0,
                        "eval_batches": 1, "checkpoint_every": 0, "precision": "fp32"}}
    for key, value in extra.items():
        recipe[key].update(value)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_training_records_the_template_and_generate_chat_uses_it(jsonl, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", _recipe(tmp_path, jsonl), "--out", str(run)]) == 0
    config = yaml.safe_load((run / "checkpoint" / "config.yaml").read_text())
    assert config["task"] == "sft" and config["tokenizer"] == {"chat_template": "default"}
    tok = load_tokenizer(run)
    assert tok.chat_template == "default"
    model, _ = load_model(run)
    expected = generate_reply(model.eval(), tok, chat_template_for(tok, "default"),
                              [{"role": "user", "content": "Uppercase: king"}],
                              GenerationConfig(max_new_tokens=8, do_sample=False))
    capsys.readouterr()
    assert main(["generate", str(run), "--chat", "Uppercase: king", "--greedy", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert main(["generate", str(run), "--chat", "hi", "--beam", "2"]) == 2  # one line: chat decodes greedily or ...
    capsys.readouterr()
    assert main(["evaluate", str(run), "--json"]) == 0  # the loss over the response tokens of the validation split
    result = json.loads(capsys.readouterr().out)
    task, *_ = _task(jsonl, tmp_path)
    assert result["tokens"] == sum(sum(t[1:]) for _, t in task.examples["val"]) and result["val_loss"] > 0


def test_the_server_chat_route_renders_with_the_recorded_template(jsonl, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from tokenloom.serving.app import ServeConfig, create_app

    run = tmp_path / "run"
    assert main(["train", _recipe(tmp_path, jsonl), "--out", str(run)]) == 0
    model, _ = load_model(run)
    tok = load_tokenizer(run)
    messages = [{"role": "user", "content": "Add 2 and 3"}]
    expected = generate_reply(model.eval(), tok, chat_template_for(tok, "default"), messages,
                              GenerationConfig(max_new_tokens=10, do_sample=False))
    app = create_app(model, tok, ServeConfig(model_name="sft", max_tokens=10, request_timeout=60))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        reply = client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": 10})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == expected
        bad = client.post("/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}]})
        assert bad.status_code == 400 and "role" in bad.json()["error"]["message"]


def test_an_imported_template_goes_through_fine_tuning_and_export(jsonl, tmp_path):
    transformers = pytest.importorskip("transformers")
    chatml = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              "{% endif %}")
    text = jsonl.read_text() * 5
    tok = Tokenizer.train_bpe(text, 300, special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=tok.vocab_size, n_positions=128, bos_token_id=0, eos_token_id=0))
    hf.save_pretrained(tmp_path / "hf")
    tok.save(tmp_path / "hf" / "tokenizer.json")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chatml, "bos_token": "<|endoftext|>"}))
    assert main(["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    section = yaml.safe_load((tmp_path / "imported" / "config.yaml").read_text())["tokenizer"]
    assert section == {"eos_token": "<|endoftext|>", "chat_template": chatml, "bos_token": "<|endoftext|>"}
    assert load_tokenizer(tmp_path / "imported").chat_template == chatml
    # fine-tuning with template auto renders with the model's own template, and keeps it
    recipe = _recipe(tmp_path, jsonl, train={"init_from": str(tmp_path / "imported"), "max_steps": 2})
    recipe_dict = yaml.safe_load(open(recipe))
    recipe_dict["model"] = {"dropout": 0.0}
    open(recipe, "w").write(yaml.safe_dump(recipe_dict))
    assert main(["train", recipe, "--out", str(tmp_path / "tuned")]) == 0
    tuned = load_tokenizer(tmp_path / "tuned")
    assert tuned.chat_template == chatml and tuned.bos_token == "<|endoftext|>"
    assert main(["export", str(tmp_path / "tuned"), "--out", str(tmp_path / "back")]) == 0
    exported = json.loads((tmp_path / "back" / "tokenizer_config.json").read_text())
    assert exported["chat_template"] == chatml
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    messages = [{"role": "user", "content": "Add 2 and 3"}]
    ours = chat_template_for(tuned, chatml).encode_prompt(tuned, messages)
    assert list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]) == ours
