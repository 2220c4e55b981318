"""Grammars compiled in killable worker processes (tokenloom.grammar.worker): the worker's index is the in-process
one, its errors are the in-process ones, a grammar past the time or memory limit is refused and its worker is gone
(replaced at the next compile), a refused grammar is refused again at once."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

pytest.importorskip("outlines_core")

from tokenloom.data.tokenizers import Tokenizer  # noqa: E402
from tokenloom.generation.constraints import ConstraintError, grammar_job  # noqa: E402
from tokenloom.grammar.compile import compile_grammar  # noqa: E402
from tokenloom.grammar.worker import CompileRefused, GrammarWorkers  # noqa: E402

EXPLODING = "(a|b|c)*a(a|b){22}"  # a DFA of ~2^22 states: minutes and gigabytes in outlines-core


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_bpe(" ".join(["abc abba cab to be or not to be, 0123456789 {\"a\": [1, 2]}"] * 20), 300)


def job(tok, **spec):
    return grammar_job(tok, tok.vocab_size, eos_id=tok.eos_id, **spec)


def compile_in(workers: GrammarWorkers, j):
    return workers.compile(j.vocabulary, j.kind, j.spec, j.what)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_worker_compiles_what_the_process_compiles(tok):
    async def run():
        workers = GrammarWorkers(seconds=30, memory_mb=512)
        try:
            out = []
            for spec in (dict(regex="(to|be)( (or|not|to|be)){2}"), dict(choice=["abba", "cab"]),
                         dict(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})):
                j = job(tok, **spec)
                out.append((await compile_in(workers, j), compile_grammar(j.vocabulary, j.kind, j.spec, j.what)))
            assert len(workers.pids) == 1  # one worker, reused
            for worker, here in out:
                assert worker.index.get_transitions() == here.index.get_transitions()
                assert worker.index.get_initial_state() == here.index.get_initial_state()
                assert (worker._finals, worker.what, worker.marker_id, worker.words) == \
                    (here._finals, here.what, here.marker_id, here.words)
            for spec in (dict(regex="[a-"), dict(regex="(?<=a)b"), dict(json_schema={"type": "foo"}),
                         dict(regex="xyz")):  # the last: no token spells x
                j = job(tok if "xyz" not in spec.values() else Tokenizer.train_char("abc"), **spec)
                with pytest.raises(ConstraintError) as there:
                    await compile_in(workers, j)
                with pytest.raises(ConstraintError) as here:
                    compile_grammar(j.vocabulary, j.kind, j.spec, j.what)
                assert str(there.value) == str(here.value) and type(there.value) is ConstraintError
            assert len(workers.pids) == 1  # an error is an answer: the worker stays
        finally:
            workers.close()
        assert not workers.pids

    asyncio.run(run())


@pytest.mark.parametrize("limit", ["time", "memory"])
def test_a_grammar_past_a_limit_is_refused_and_its_worker_killed(tok, limit):
    async def run():
        seconds, memory_mb = (1.0, 1024) if limit == "time" else (60.0, 64)
        workers = GrammarWorkers(seconds=seconds, memory_mb=memory_mb)
        try:
            await compile_in(workers, job(tok, regex="[a-c]+"))
            (pid,) = workers.pids
            start = time.perf_counter()
            with pytest.raises(CompileRefused) as err:
                await compile_in(workers, job(tok, regex=EXPLODING))
            took = time.perf_counter() - start
            assert err.value.reason == limit and "\n" not in str(err.value)
            assert ("took over 1 s" if limit == "time" else "needed over 64 MB") in str(err.value)
            assert took < (seconds + 1.5 if limit == "time" else 10)
            assert gone(pid) and not workers.pids  # killed and reaped
            start = time.perf_counter()
            with pytest.raises(CompileRefused):  # refused again, without a worker
                await compile_in(workers, job(tok, regex=EXPLODING))
            assert time.perf_counter() - start < 0.1 and not workers.pids
            compiled = await compile_in(workers, job(tok, regex="(ab)+"))  # a new worker, started lazily
            assert compiled.index.get_final_states() and len(workers.pids) == 1 and workers.pids[0] != pid
        finally:
            workers.close()

    asyncio.run(run())


def test_a_cancelled_compile_kills_its_worker(tok):
    async def run():
        workers = GrammarWorkers(seconds=30, memory_mb=1024)
        task = asyncio.ensure_future(compile_in(workers, job(tok, regex=EXPLODING)))
        for _ in range(100):  # the worker started
            await asyncio.sleep(0.02)
            if workers.pids:
                break
        (pid,) = workers.pids
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gone(pid) and not workers.pids

    asyncio.run(run())
