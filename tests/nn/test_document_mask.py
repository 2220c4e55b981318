"""Packed rows (several examples in one sequence, told apart by ``documents``) never attend across examples: their
logits equal those of each example run on its own, for every position scheme, with GQA and a sliding window, and
causality still holds inside an example."""

from __future__ import annotations

import pytest
import torch

from tokenloom.models.gpt import GPT, GPTConfig
from tokenloom.models.registry import takes_documents
from tokenloom.models.universal import UniversalConfig, UniversalTransformer
from tokenloom.nn.masks import attention_mask, document_positions, sequence_span

LENGTHS = (5, 7, 4)  # examples A | B | C, then 3 positions of padding
ROW = sum(LENGTHS) + 3


def _examples(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=g) for n in LENGTHS]


def _packed(examples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(1, ROW, dtype=torch.long)
    docs = torch.zeros(1, ROW, dtype=torch.long)
    start = 0
    for d, ex in enumerate(examples, start=1):
        ids[0, start:start + len(ex)] = ex
        docs[0, start:start + len(ex)] = d
        start += len(ex)
    return ids, docs


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    base = dict(vocab_size=40, num_layers=2, num_heads=4, embed_dim=32, max_seq_len=32, dropout=0.0)
    return GPT(GPTConfig(**{**base, **kw})).eval()


def _check_packed_equals_separate(model, vocab: int = 40) -> None:
    examples = _examples(vocab)
    ids, docs = _packed(examples)
    with torch.no_grad():
        packed = model(ids, documents=docs)[0]  # (T, V)
        start = 0
        for ex in examples:
            alone = model(ex[None])[0]
            torch.testing.assert_close(packed[start:start + len(ex)], alone, rtol=1e-5, atol=1e-5)
            start += len(ex)


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "rope", "alibi", "t5"])
def test_packed_rows_equal_separate_examples(position: str) -> None:
    _check_packed_equals_separate(_gpt(position=position))


def test_packed_rows_equal_separate_with_gqa_and_sdpa_and_math() -> None:
    for attention in ("sdpa", "math"):
        _check_packed_equals_separate(_gpt(position="rope", num_kv_heads=2, attention=attention))


def test_packed_rows_equal_separate_with_a_sliding_window() -> None:
    # a window longer than every example: the banded fast path is skipped, the dense mask keeps the examples apart
    _check_packed_equals_separate(_gpt(position="rope", attention_window=4))


def test_universal_transformer_packs_too() -> None:
    torch.manual_seed(0)
    model = UniversalTransformer(UniversalConfig(vocab_size=40, num_heads=4, embed_dim=32, max_seq_len=32,
                                                 max_steps=3, dropout=0.0)).eval()
    assert takes_documents(model) and takes_documents(_gpt())
    _check_packed_equals_separate(model)


def test_explicit_positions_equal_the_derived_ones() -> None:
    model = _gpt(position="learned")
    ids, docs = _packed(_examples(40))
    positions = document_positions(docs)
    assert positions[0].tolist() == [*range(5), *range(7), *range(4), 0, 0, 0]
    with torch.no_grad():
        torch.testing.assert_close(model(ids, documents=docs), model(ids, documents=docs, positions=positions))


def test_causality_inside_a_packed_example() -> None:
    model = _gpt(position="rope")
    ids, docs = _packed(_examples(40))
    changed = ids.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 40  # a token of example B (positions 5..11)
    with torch.no_grad():
        a, b = model(ids, documents=docs), model(changed, documents=docs)
    torch.testing.assert_close(a[0, :8], b[0, :8])  # A and B's earlier tokens: unchanged
    torch.testing.assert_close(a[0, 12:16], b[0, 12:16])  # C: unchanged (it cannot see B)
    assert not torch.allclose(a[0, 8:12], b[0, 8:12])


def test_the_mask_is_block_diagonal_and_causal() -> None:
    docs = torch.tensor([[1, 1, 2, 2, 2, 0]])
    mask, is_causal = attention_mask(sequence_span(6, None, docs), 6, causal=True, dtype=torch.float32,
                                     device=torch.device("cpu"))
    allowed = (mask[0, 0] == 0).int()
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [0, 0, 1, 0, 0, 0],
                             [0, 0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 0, 0, 0]])  # the padding query sees nothing (a uniform, ignored row)
    assert not is_causal and torch.equal(allowed, expected)


def test_documents_refuse_a_cache() -> None:
    model = _gpt()
    ids, docs = _packed(_examples(40))
    with pytest.raises(ValueError, match="whole-sequence"):
        model(ids, documents=docs, cache=model.create_cache(1))
