"""Where a Hugging Face model is: a directory, or a hub name (``gpt2``, ``org/name``) already in the local cache.

:func:`resolve_hf_model` is the one place every command that takes a Hugging Face model (``tokenloom import hf``,
:func:`~tokenloom.interop.hf.from_hf`, the ``read_hf_*`` readers) turns its argument into a directory. A hub name is
looked up with ``huggingface_hub.snapshot_download(..., local_files_only=True)`` in the cache that
``HF_HUB_CACHE`` names (else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), read from the environment at
each call: nothing is ever downloaded, and a name that is not there is a one-line error saying how to fetch it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache as ``huggingface_hub`` finds it: ``HF_HUB_CACHE`` (or the older
    ``HUGGINGFACE_HUB_CACHE``), else ``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub`` (``~/.cache``)."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_hf_model(source: str | os.PathLike[str]) -> Path:
    """The Hugging Face model directory ``source`` names: itself when it is a directory, else the snapshot of the hub
    name ``source`` (its ``main`` revision) in the local cache (:func:`hub_cache_dir`). Never downloads; a path that
    is missing, or a name that is not in the cache, is a one-line :class:`CheckpointError`."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file, not a Hugging Face model directory")
    name = os.fspath(source)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub comes with tokenizers
        raise CheckpointError(f"Hugging Face model directory not found: {name}") from None
    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(name, cache_dir=cache, local_files_only=True))
    except ValueError:  # HFValidationError: not a hub name ("./x", "/a/b", "a/b/c"), so a missing directory
        raise CheckpointError(f"Hugging Face model directory not found: {name}") from None
    except OSError:  # LocalEntryNotFoundError: a hub name that is not in the cache
        raise CheckpointError(
            f"{name!r} is neither a directory nor in the local Hugging Face cache (HF_HUB_CACHE={cache}); nothing is "
            f"downloaded: fetch it with `hf download {name}` (older huggingface_hub: `huggingface-cli download "
            f"{name}`) on a machine with network, or pass a directory") from None
