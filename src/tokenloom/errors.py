"""User-facing errors.

Every error a user can cause (a bad config, a missing file, a corrupt checkpoint, a prompt that does
not fit) is a :class:`TokenloomError` subclass carrying a one-line explanation. The CLI prints it
without a traceback and exits non-zero.
"""

from __future__ import annotations


class TokenloomError(Exception):
    """Base class for errors caused by user input; ``str(err)`` is a one-line explanation."""


class ConfigError(TokenloomError, ValueError):
    """A config field is unknown, of the wrong type, or out of range."""


class RegistryError(ConfigError, KeyError):
    """A named part (attention backend, position scheme, ...) is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DataError(TokenloomError):
    """A data file is missing, empty or unreadable."""


class CheckpointError(TokenloomError):
    """A checkpoint directory is missing, truncated or corrupt."""


class TokenizerError(TokenloomError):
    """Text cannot be encoded (characters outside the vocabulary) or ids cannot be decoded."""


class GenerationError(TokenloomError, ValueError):
    """A generation request cannot be served (prompt too long, bad ids, bad settings)."""


class TrainingError(TokenloomError):
    """Training cannot go on (e.g. the loss or the gradients stayed non-finite); the last checkpoint is intact."""
