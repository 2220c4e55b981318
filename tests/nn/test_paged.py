"""The paged cache strategy: attention over a pool of blocks in any layout equals dense attention over whole
sequences, for every position scheme, grouped-query heads, a sliding window, one-token steps, speculative-style
multi-token rows and packed chunks of several sequences in one call."""

import random

import pytest
import torch

from tokenloom.models.gpt import GPT, GPTConfig
from tokenloom.nn.paged import PagedKVCache

BS = 4  # block size


def tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    config = dict(vocab_size=50, num_layers=2, num_heads=4, embed_dim=32, max_seq_len=64, dropout=0.0)
    config.update(overrides)
    return GPT(GPTConfig(**config)).eval()


def pool_for(model: GPT, num_blocks: int) -> PagedKVCache:
    c = model.config
    return PagedKVCache(c.num_layers, num_blocks, c.num_kv_heads or c.num_heads, BS, c.head_dim)


class Sequences:
    """R sequences over a shuffled pool: each gets blocks at random places as it grows."""

    def __init__(self, model: GPT, lengths: list[int], rng: random.Random, num_blocks: int = 80) -> None:
        self.model, self.rng = model, rng
        self.ids = [torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n * 7 + i)).tolist()
                    for i, n in enumerate(lengths)]
        self.cache = pool_for(model, num_blocks)
        self.free = list(range(num_blocks))
        rng.shuffle(self.free)
        self.tables = [[] for _ in lengths]
        self.done = [0] * len(lengths)  # columns written

    def ensure(self, r: int, upto: int) -> None:
        while len(self.tables[r]) * BS < upto:
            self.tables[r].append(self.free.pop())

    def call(self, segments: list[tuple[int, int]], packed: bool) -> list[torch.Tensor]:
        """Run segments (sequence r, n new tokens) in one call: packed (1, N), or (R, n) when all n are equal;
        -> each segment's (n, V) logits."""
        for r, n in segments:
            self.ensure(r, self.done[r] + n)
        width = max(len(self.tables[r]) for r, _ in segments)
        tables = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r, _ in segments])
        lengths = torch.tensor([self.done[r] for r, _ in segments])
        counts = torch.tensor([n for _, n in segments])
        tokens = [self.ids[r][self.done[r]:self.done[r] + n] for r, n in segments]
        positions = [list(range(self.done[r], self.done[r] + n)) for r, n in segments]
        if packed:
            ids = torch.tensor([sum(tokens, [])])
            pos = torch.tensor([sum(positions, [])])
            view = self.cache.view(tables, lengths, counts)
        else:
            ids, pos = torch.tensor(tokens), torch.tensor(positions)
            view = self.cache.view(tables, lengths)
        with torch.inference_mode():
            logits = self.model(ids, positions=pos, cache=view)
        for r, n in segments:
            self.done[r] += n
        if packed:
            return list(logits[0].split(counts.tolist()))
        return list(logits)

    def reference(self, r: int) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(torch.tensor([self.ids[r]]))[0]


CASES = {
    "learned": {}, "rope-gqa": dict(position="rope", num_kv_heads=2), "alibi": dict(position="alibi"),
    "t5": dict(position="t5"), "sinusoidal": dict(position="sinusoidal"),
    "window": dict(position="rope", attention_window=8),
    "speedrun": dict(position="rope", num_kv_heads=2, norm="rmsnorm", qk_norm=True, logit_softcap=2.0, mlp="relu2"),
    "speedrun-stack": dict(position="rope", num_kv_heads=2, value_embeddings=1, unet_skips=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_equals_dense_for_random_layouts(case: str) -> None:
    model = tiny(**CASES[case])
    rng = random.Random(hash(case) % 1000)
    lengths = [rng.randint(5, 40) for _ in range(5)]
    seqs = Sequences(model, lengths, rng)
    got: list[list[torch.Tensor]] = [[] for _ in lengths]
    while any(d < n for d, n in zip(seqs.done, lengths, strict=True)):
        left = [r for r, n in enumerate(lengths) if seqs.done[r] < n]
        chosen = rng.sample(left, rng.randint(1, len(left)))
        mode = rng.choice(["packed", "steps", "rows"])
        if mode == "steps" or all(seqs.done[r] > 0 for r in chosen) and mode == "rows":
            n = 1 if mode == "steps" else min(min(lengths[r] - seqs.done[r] for r in chosen), rng.randint(1, 5))
            segments = [(r, n) for r in chosen]
            outs = seqs.call(segments, packed=False)
        else:
            segments = [(r, rng.randint(1, min(12, lengths[r] - seqs.done[r]))) for r in chosen]
            outs = seqs.call(segments, packed=True)
        for (r, _), out in zip(segments, outs, strict=True):
            got[r].append(out)
    for r in range(len(lengths)):
        torch.testing.assert_close(torch.cat(got[r]), seqs.reference(r), atol=2e-5, rtol=1e-4)


def test_rows_sharing_a_prefix_block_read_the_same_keys() -> None:
    """Two sequences with the same first block (forked): each continues on its own blocks and equals its dense pass."""
    model = tiny(position="rope")
    seqs = Sequences(model, [10, 10], random.Random(1))
    seqs.ids[1][:BS * 2] = seqs.ids[0][:BS * 2]
    seqs.call([(0, BS * 2)], packed=True)
    seqs.tables[1] = list(seqs.tables[0])  # share both full blocks
    seqs.done[1] = BS * 2
    a = seqs.call([(0, 2), (1, 2)], packed=False)
    torch.testing.assert_close(a[0], seqs.reference(0)[BS * 2:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(a[1], seqs.reference(1)[BS * 2:], atol=2e-5, rtol=1e-4)


def test_a_paged_view_refuses_padding() -> None:
    model = tiny()
    view = pool_for(model, 4).view(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="not padded"):
        model(torch.tensor([[1, 2]]), positions=torch.tensor([[0, 1]]), attention_mask=torch.ones(1, 2), cache=view)
