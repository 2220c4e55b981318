"""A checkpoint's ``checksums.json`` (the SHA-256 of each of its other files) and the check every loader makes.

:func:`tokenloom.checkpoint.write_checkpoint` writes it; :func:`~tokenloom.checkpoint.read_config`,
:func:`~tokenloom.checkpoint.load_tokenizer`, :func:`~tokenloom.checkpoint.read_weights` /
:func:`~tokenloom.checkpoint.load_model` and the adapter readers check each file they read against it (a checkpoint
without one, from before checksums or converted by hand, loads as it is). A damaged file is a one-line
:class:`~tokenloom.errors.ChecksumError` naming it.

Cost: small files are hashed before they are parsed. The weights are hashed in a background thread while the block
that loads them runs (:func:`verified`: file reads and hashlib release the GIL), in 4 MiB reads that stay in cache
between the read and the hash; the loaded model counts only once the digest agrees. SHA-256 runs at about
1.2-1.4 GB/s a core (SHA-NI), so on a warm page cache a large float32 checkpoint loads faster than it hashes and the
hash sets the time (``benchmarks/bench_checkpoint_verify.py``). A file found intact (by a load, or by
``checkpoint_damage`` before a resume) is not hashed again while its device, inode, size and times stay the same, in
this process and in later ones (``verified.json`` in :func:`~tokenloom.hardware.cache_dir`, as git's index trusts a
file whose stat is unchanged): any write to the file changes its ctime, which no program can set back, so an edited
file is always hashed again; what this does not catch is a disk that rots a byte under an unchanged inode. A file
changed less than :data:`RACY_SECONDS` before it was hashed is not remembered (a coarse file-system clock could give
an in-place change in that window the same times).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import CheckpointError, ChecksumError
from .files import sha256_file

CHECKSUM_FILE = "checksums.json"
RACY_SECONDS = 2.0  # a file changed less than this before it was hashed is hashed again when next read
HASH_BLOCK = 4 << 20  # bytes per read: small enough to stay in cache between the read and the hash
_VERIFIED: dict[str, tuple[tuple[int, ...], str]] = {}  # absolute path -> (stat identity, SHA-256) found intact
_VERIFIED_MAX = 256
_VERIFIED_FILE = "verified.json"  # _VERIFIED between processes, in the cache directory
_loaded = False  # whether _VERIFIED holds the cache directory's entries yet
_LOCK = threading.RLock()  # _VERIFIED is written by the hashing threads
_IN_PROGRESS: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("tokenloom_hashing", default=frozenset())


def write_checksums(directory: Path) -> None:
    """``checksums.json``: the SHA-256 of every other file of the checkpoint in ``directory``."""
    sums = {f.name: sha256_file(f) for f in sorted(directory.iterdir()) if f.is_file() and f.name != CHECKSUM_FILE}
    (directory / CHECKSUM_FILE).write_text(json.dumps(sums, indent=1) + "\n", encoding="utf-8")


def read_checksums(directory: str | Path) -> dict[str, str] | None:
    """File name -> SHA-256 as the ``checksums.json`` of the checkpoint ``directory`` records them, or None when it
    has none; an unreadable or malformed one is a one-line :class:`CheckpointError`."""
    manifest = Path(directory) / CHECKSUM_FILE
    if not manifest.is_file():
        return None
    try:
        sums = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{manifest} is unreadable") from None
    if not (isinstance(sums, dict) and all(isinstance(v, str) for v in sums.values())):
        raise CheckpointError(f"{manifest} is unreadable (not a mapping of file names to SHA-256 digests)")
    return sums


def verify_file(file: Path, expected: str, stop: threading.Event | None = None) -> None:
    """Hash ``file`` and compare with ``expected``: a one-line :class:`ChecksumError` naming it when they differ (a
    :class:`CheckpointError` when it cannot be read). A file found intact is remembered (see :data:`RACY_SECONDS`),
    and one remembered and unchanged since is not hashed again. ``stop`` set: give up midway, quietly."""
    if _known_intact(file, expected):
        return
    started = time.time_ns()
    try:
        hashed = _sha256(file, stop)
    except OSError as err:
        raise CheckpointError(f"{file} cannot be read ({err.strerror or err})") from None
    if hashed is None:
        return
    digest, before, after = hashed
    if digest != expected:
        raise ChecksumError(f"{file} does not match its checksum in {CHECKSUM_FILE} (truncated or corrupt)")
    if _identity(before) == _identity(after) and \
            started - max(before.st_mtime_ns, before.st_ctime_ns) > RACY_SECONDS * 1e9:
        _remember(str(file.absolute()), (_identity(before), expected))


def forget_verified() -> None:
    """Forget which files were found intact (here and in the cache directory): the next reads hash them again."""
    global _loaded
    with _LOCK, contextlib.suppress(OSError):
        _VERIFIED.clear()
        _loaded = True
        _verified_path().unlink()


def _verified_path() -> Path:
    from .hardware import cache_dir

    return cache_dir() / _VERIFIED_FILE


def _load_verified() -> None:
    """The entries of earlier processes into :data:`_VERIFIED`, once; a missing, unreadable or malformed file (or one
    over 1 MiB) counts as empty."""
    global _loaded
    with _LOCK, contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        if _loaded:
            return
        _loaded = True
        path = _verified_path()
        if path.stat().st_size > 1 << 20:
            return
        for key, (identity, digest) in json.loads(path.read_text(encoding="utf-8")).items():
            if isinstance(key, str) and isinstance(digest, str) and len(identity) == 5 and \
                    all(isinstance(n, int) for n in identity):
                _VERIFIED[key] = (tuple(identity), digest)
        while len(_VERIFIED) > _VERIFIED_MAX:
            _VERIFIED.pop(next(iter(_VERIFIED)))


def _remember(key: str, entry: tuple[tuple[int, ...], str]) -> None:
    """Record ``key`` as found intact, here and (best effort, written atomically) in the cache directory."""
    _load_verified()
    with _LOCK, contextlib.suppress(OSError):
        _VERIFIED.pop(key, None)
        _VERIFIED[key] = entry
        while len(_VERIFIED) > _VERIFIED_MAX:
            _VERIFIED.pop(next(iter(_VERIFIED)))
        path = _verified_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({k: [list(i), d] for k, (i, d) in _VERIFIED.items()}), encoding="utf-8")
        os.replace(tmp, path)


def check_file(directory: str | Path, name: str) -> None:
    """Check the file ``name`` of the checkpoint ``directory`` against its ``checksums.json`` before it is read:
    nothing to check without one, when it lists no such file, or when the file is absent (its reader says so); a
    one-line :class:`ChecksumError` naming the file when its bytes are not those written."""
    with verified(directory, name, background=False):
        pass


@contextlib.contextmanager
def verified(directory: str | Path, name: str, *, background: bool = True) -> Iterator[None]:
    """Check the file ``name`` of the checkpoint ``directory`` (like :func:`check_file`) while the block reads it:
    hashed in a background thread alongside the block (else, ``background=False``, before it); the block's result
    counts only when the ``with`` exits without error. When the block fails and the file does not match, the mismatch
    is the error raised (a damaged file explains the failure). Nested blocks for the same file hash it once."""
    file = Path(directory) / name
    key = str(file.absolute())
    sums = read_checksums(directory)
    expected = None if sums is None else sums.get(name)
    if expected is None or key in _IN_PROGRESS.get() or not file.is_file() or _known_intact(file, expected):
        yield
        return
    if not background:
        verify_file(file, expected)
        yield
        return
    outcome: list[BaseException | None] = []
    stop = threading.Event()

    def run() -> None:
        try:
            verify_file(file, expected, stop)
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(err)

    thread = threading.Thread(target=run, name=f"tokenloom-checksum-{name}", daemon=True)
    thread.start()
    token = _IN_PROGRESS.set(_IN_PROGRESS.get() | {key})
    try:
        yield
    except Exception:
        thread.join()
        if outcome and isinstance(outcome[0], ChecksumError):
            raise outcome[0] from None
        raise
    except BaseException:  # Ctrl-C: stop hashing, do not wait for it
        stop.set()
        raise
    finally:
        _IN_PROGRESS.reset(token)
    thread.join()
    if outcome and outcome[0] is not None:
        raise outcome[0]


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _known_intact(file: Path, expected: str) -> bool:
    """Whether ``file`` was found to be ``expected`` (in this process or an earlier one) and is unchanged since."""
    _load_verified()
    entry = _VERIFIED.get(str(file.absolute()))
    if entry is None or entry[1] != expected:
        return False
    try:
        return _identity(file.stat()) == entry[0]
    except OSError:
        return False


def _sha256(file: Path, stop: threading.Event | None = None) -> tuple[str, os.stat_result, os.stat_result] | None:
    """(hex SHA-256 of ``file``, its stat before and after the reads), read in :data:`HASH_BLOCK` blocks into one
    buffer; None when ``stop`` was set midway."""
    digest, buffer = hashlib.sha256(), bytearray(HASH_BLOCK)
    view = memoryview(buffer)
    with file.open("rb") as f:
        before = os.fstat(f.fileno())
        while n := f.readinto(buffer):
            digest.update(view[:n])
            if stop is not None and stop.is_set():
                return None
        return digest.hexdigest(), before, os.fstat(f.fileno())
