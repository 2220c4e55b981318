"""Grammars compiled in worker processes that can be killed: :class:`GrammarWorkers`, the server's compiler.

A regex or schema whose automaton explodes (``(a|b)*a(a|b){22}``, ``a{0,100000}``) takes outlines-core minutes and
gigabytes, and a thread cannot be stopped. Here the compile runs in a worker process (spawned: a fresh interpreter
that imports outlines-core and :mod:`tokenloom.grammar.compile`, no torch, not the server's ``__main__``), under a
wall-clock limit (the worker is killed at it) and a memory cap (``RLIMIT_DATA`` set in the worker: outlines-core's
Rust allocator aborts the worker when an allocation would pass it). Either way the worker is gone, its memory back
with the OS, and a later compile starts a new one (lazily: a server whose requests never ask for a grammar never
starts one). The compiled index comes back pickled (outlines-core's ``Index`` pickles as its binary form); a
tokenizer's vocabulary goes to each worker once, before its first compile over it::

    workers = GrammarWorkers(seconds=10, memory_mb=1024)
    compiled = await workers.compile(vocabulary, "regex", "[a-z]+", "regex '[a-z]+'")  # a Compiled
    workers.close()

Raises :class:`CompileRefused` (``reason``: ``"time"`` or ``"memory"``; a refused grammar is refused again at once),
:class:`~.compile.ConstraintError` for a grammar that does not compile, :class:`CompilerBusy` when every worker stayed
busy for ``seconds``.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections import OrderedDict
from multiprocessing.connection import Connection
from pathlib import Path

from ..errors import TokenloomError
from .compile import Compiled, ConstraintError, Vocabulary, compile_grammar, library, one_line

COMPILE_SECONDS = 10.0  # a compile's wall-clock limit: the worker is killed at it
COMPILE_MEMORY_MB = 1024  # the memory a compile may use in its worker, over the worker's own (~30 MB)
WORKERS = 2  # compiles running at once (each a process); more wait for one, at most COMPILE_SECONDS
_NICE = 10  # workers yield the CPU to the server's decoding
_VOCABULARIES = 8  # vocabularies a worker keeps
_REFUSED = 256  # refused grammars remembered (per vocabulary and spec)
_MEMORY_EXIT = 3  # a worker's exit code after a MemoryError


class CompileRefused(ConstraintError):
    """A grammar over a limit: ``reason`` is ``"time"`` or ``"memory"``; ``str(err)`` is one line."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class CompilerBusy(TokenloomError):
    """Every worker stayed busy compiling for the whole wait; ``str(err)`` is one line."""


# ---- the worker process -------------------------------------------------------------------------------------------

def _data_bytes() -> int:
    """This process's data segment (VmData: heap and private anonymous maps, what RLIMIT_DATA counts), 0 if unknown."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def serve() -> None:
    """A worker process's main (``sys.argv``: the socket's file descriptor, the memory cap in bytes): caps itself,
    then answers the server (see :func:`_serve`)."""
    _die_with_the_server()
    _serve(Connection(int(sys.argv[1])), int(sys.argv[2]))


def _die_with_the_server() -> None:
    """SIGKILL this worker when the server that started it dies (Linux; elsewhere it ends at the closed pipe)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(conn: Connection, memory_bytes: int) -> None:
    """The worker's loop: ``("vocabulary", serial, marker_id, pickled)`` stores a vocabulary, ``("compile", serial,
    kind, spec, what)`` answers ``("ok", Compiled)`` or ``("error", message)``; ends when the server closes the pipe.
    Says ``("ready",)`` first, once started and capped."""
    import resource

    library()  # imported before the cap (and the clock of a first compile)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the server's terminal is the server's to handle
    os.nice(_NICE)
    limit = _data_bytes() + memory_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    conn.send(("ready",))
    vocabularies: OrderedDict[int, Vocabulary] = OrderedDict()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "vocabulary":
            _, serial, marker_id, data = message
            vocabularies[serial] = Vocabulary(pickle.loads(data), marker_id, serial)
            while len(vocabularies) > _VOCABULARIES:
                vocabularies.popitem(last=False)
            continue
        _, serial, kind, spec, what = message
        try:
            conn.send(("ok", compile_grammar(vocabularies[serial], kind, spec, what)))
        except MemoryError:  # Python's allocations past the cap (the Rust ones abort the process)
            os._exit(_MEMORY_EXIT)
        except ConstraintError as err:
            conn.send(("error", str(err)))
        except Exception as err:  # noqa: BLE001 - the library's own failure: one line to the server
            conn.send(("error", f"the grammar compiler failed: {one_line(err)}"))


class _Worker:
    """One worker process and the server's end of its pipe."""

    def __init__(self, memory_bytes: int) -> None:
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])  # the directory holding tokenloom/
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root,
                                                                          os.environ.get("PYTHONPATH")]))}
        # a fresh interpreter (fork + exec, never a bare fork of a process holding torch's threads), which unlike
        # multiprocessing's spawn does not re-run the server's __main__
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from tokenloom.grammar.worker import serve; serve()", str(theirs.fileno()),
             str(memory_bytes)], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.sent: OrderedDict[int, None] = OrderedDict()  # the vocabularies it holds, kept as it keeps them

    def send_vocabulary(self, vocabulary: Vocabulary) -> None:
        if vocabulary.serial in self.sent:
            return
        self.conn.send(("vocabulary", vocabulary.serial, vocabulary.marker_id, vocabulary.pickled()))
        self.sent[vocabulary.serial] = None
        while len(self.sent) > _VOCABULARIES:
            self.sent.popitem(last=False)

    def kill(self) -> None:
        """Stop it now (SIGKILL) and reap it: its memory is the OS's again."""
        self.process.kill()
        self.process.wait()
        self.conn.close()


class GrammarWorkers:
    """Up to ``workers`` worker processes compiling grammars, each compile limited to ``seconds`` and ``memory_mb``
    (see the module docstring). Used from one event loop at a time."""

    def __init__(self, seconds: float = COMPILE_SECONDS, memory_mb: int = COMPILE_MEMORY_MB,
                 workers: int = WORKERS) -> None:
        self.seconds, self.memory_mb, self.workers = seconds, memory_mb, workers
        self._idle: list[_Worker] = []
        self._running: set[_Worker] = set()
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refused: OrderedDict[tuple, CompileRefused] = OrderedDict()  # grammars refused: refused again at once

    @property
    def pids(self) -> list[int]:
        """The worker processes alive now (idle or compiling)."""
        return [w.process.pid for w in (*self._idle, *self._running)]

    async def compile(self, vocabulary: Vocabulary, kind: str, spec: str, what: str) -> Compiled:
        """The grammar compiled in a worker; a worker past a limit is killed (see the module docstring)."""
        key = (vocabulary.serial, kind, spec)
        if (refused := self._refused.get(key)) is not None:
            raise CompileRefused(str(refused), refused.reason)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._slots = loop, asyncio.Semaphore(self.workers)
        try:
            await asyncio.wait_for(self._slots.acquire(), self.seconds)
        except asyncio.TimeoutError:
            raise CompilerBusy(f"the server's {self.workers} grammar compilers stayed busy for {self.seconds:g} s; "
                               "retry later") from None
        try:
            return await self._run(vocabulary, ("compile", vocabulary.serial, kind, spec, what))
        except CompileRefused as err:
            self._refused[key] = err
            while len(self._refused) > _REFUSED:
                self._refused.popitem(last=False)
            raise
        finally:
            self._slots.release()

    async def _run(self, vocabulary: Vocabulary, message: tuple) -> Compiled:
        deadline = asyncio.get_running_loop().time() + self.seconds
        while self._idle and self._idle[-1].process.poll() is not None:  # died idle (e.g. with the thread that
            self._idle.pop().kill()  # started it: PR_SET_PDEATHSIG follows the thread): reap it, take another
        fresh = not self._idle
        worker = _Worker(self.memory_mb << 20) if fresh else self._idle.pop()
        self._running.add(worker)
        done = False
        try:
            if fresh:
                await self._answer(worker, deadline)  # ("ready",): started, the cap set
            worker.send_vocabulary(vocabulary)
            worker.conn.send(message)
            status, value = await self._answer(worker, deadline)
            done = True
        finally:
            self._running.discard(worker)
            if done:
                self._idle.append(worker)
            else:  # over a limit, or the request went away: nothing left running
                worker.kill()
        if status == "error":
            raise ConstraintError(value)
        return value

    async def _answer(self, worker: _Worker, deadline: float) -> tuple:
        """The worker's next message, by ``deadline`` (loop time)."""
        if not await _readable(worker.conn, deadline - asyncio.get_running_loop().time()):
            raise CompileRefused(f"took over {self.seconds:g} s to compile (a grammar whose automaton explodes, "
                                 "e.g. (a|b)*a(a|b){20}); simplify it", "time")
        try:
            return worker.conn.recv()
        except (EOFError, OSError):  # the worker died
            try:
                code = worker.process.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
        if code in (-signal.SIGABRT, _MEMORY_EXIT):  # an allocation past the cap (Rust aborts, Python exits)
            raise CompileRefused(f"needed over {self.memory_mb} MB to compile (a grammar whose automaton explodes, "
                                 "e.g. (a|b)*a(a|b){20}); simplify it", "memory")
        raise ConstraintError(f"the grammar compiler stopped (exit code {code})")

    def close(self) -> None:
        """Stop every worker (the server's shutdown)."""
        for worker in (*self._idle, *self._running):
            worker.kill()
        self._idle.clear()
        self._running.clear()


async def _readable(conn, seconds: float) -> bool:  # noqa: ANN001 - a multiprocessing Connection
    """Whether ``conn`` has data (or is closed) within ``seconds``, waited for on the event loop (no thread)."""
    if conn.poll(0):
        return True
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, seconds)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
