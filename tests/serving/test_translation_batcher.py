"""The translation batcher: concurrent requests of one beam width run in one call of the model, each gets its own
sentences back, and a failing request fails alone."""

import asyncio
import threading

import pytest

from tokenloom.errors import TokenloomError
from tokenloom.serving.routes.translations import TranslationBatcher


def test_requests_waiting_while_a_batch_runs_share_the_next_call():
    calls, gate = [], threading.Event()

    def run(sources, options):
        calls.append((list(sources), options))
        if len(calls) == 1:
            gate.wait(5)  # the first batch is slow: the others queue behind it
        return [s.upper() + f"/{options['beam']}" for s in sources]

    async def main():
        batcher = TranslationBatcher(run)
        first = asyncio.ensure_future(batcher.translate(["a"], {"beam": 1}))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(batcher.translate(s, o)) for s, o in
                ((["b", "c"], {"beam": 1}), (["d"], {"beam": 2}), (["e"], {"beam": 1}))]
        await asyncio.sleep(0.05)
        gate.set()
        return await first, await asyncio.gather(*rest), batcher

    first, rest, batcher = asyncio.run(main())
    assert first == ["A/1"] and rest == [["B/1", "C/1"], ["D/2"], ["E/1"]]
    assert calls == [(["a"], {"beam": 1}), (["b", "c", "e"], {"beam": 1}), (["d"], {"beam": 2})]
    assert (batcher.batches, batcher.sentences) == (3, 5)


def test_a_failing_request_fails_alone():
    def run(sources, options):
        if "bad" in sources:
            raise TokenloomError("cannot translate 'bad'")
        return [s * 2 for s in sources]

    async def main():
        batcher = TranslationBatcher(run)
        jobs = [batcher.translate(s, {}) for s in (["x"], ["bad"], ["y", "z"])]
        return await asyncio.gather(*jobs, return_exceptions=True)

    good, bad, more = asyncio.run(main())
    assert good == ["xx"] and more == ["yy", "zz"]
    assert isinstance(bad, TokenloomError) and "bad" in str(bad)


@pytest.mark.parametrize("n", [300])
def test_a_batch_holds_at_most_max_batch_sentences(n):
    sizes = []

    def run(sources, options):
        sizes.append(len(sources))
        return sources

    async def main():
        batcher = TranslationBatcher(run)
        return await asyncio.gather(*(batcher.translate([str(i)] * 100, {}) for i in range(n // 100)))

    out = asyncio.run(main())
    assert [len(o) for o in out] == [100] * (n // 100) and max(sizes) <= 256 and sum(sizes) == n
