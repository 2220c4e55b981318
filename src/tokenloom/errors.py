"""User-facing errors.

Every error a user can cause (a bad config, a missing file, a corrupt checkpoint, a prompt that does
not fit) is a :class:`TokenloomError` subclass carrying a one-line explanation. The CLI prints it
without a traceback and exits non-zero. A config with several problems raises them together
(:class:`ConfigProblems`: a header line and one indented line per problem).
"""

from __future__ import annotations

from collections.abc import Sequence


class TokenloomError(Exception):
    """Base class for errors caused by user input; ``str(err)`` is a one-line explanation."""


class ConfigError(TokenloomError, ValueError):
    """A config field is unknown, of the wrong type, or out of range."""


class ConfigProblems(ConfigError):
    """Every problem found in one config, each a one-line :class:`ConfigError` (``errors``). ``str()``: the problem
    itself when there is one, else a header line and one indented line per problem::

        3 problems in configs/x.yaml:
          - unknown key 'train.max_step' (did you mean 'max_steps'?)
          - model.embed_dim=10 must be divisible by num_heads=3
          - data.val_size must be >= 1, got 0
    """

    def __init__(self, errors: Sequence[ConfigError], source: str | None = None) -> None:
        self.errors = unique_problems(errors)
        self.source = source
        super().__init__(self._text())

    @property
    def problems(self) -> list[str]:
        """The problems' messages."""
        return [str(err) for err in self.errors]

    def _text(self) -> str:
        if len(self.errors) == 1:
            return str(self.errors[0])
        lines = [getattr(err, "brief", None) or str(err) for err in self.errors]
        return f"{len(lines)} problems in {self.source or 'the config'}:\n" + "\n".join(f"  - {line}" for line in lines)

    def __str__(self) -> str:
        return self._text()

    def __reduce__(self) -> tuple:  # (pickled across processes: rebuilt from the problems, not the text)
        return type(self), (self.errors, self.source)


def unique_problems(errors: Sequence[ConfigError]) -> list[ConfigError]:
    """``errors`` with nested :class:`ConfigProblems` flattened and repeated messages dropped (order kept)."""
    flat = [e for err in errors for e in (err.errors if isinstance(err, ConfigProblems) else [err])]
    seen: set[str] = set()
    return [err for err in flat if not (str(err) in seen or seen.add(str(err)))]


class RegistryError(ConfigError, KeyError):
    """A named part (attention backend, position scheme, ...) is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DataError(TokenloomError):
    """A data file is missing, empty or unreadable."""


class CheckpointError(TokenloomError):
    """A checkpoint directory is missing, truncated or corrupt."""


class ChecksumError(CheckpointError):
    """A checkpoint file's bytes are not those its ``checksums.json`` records (truncated, corrupt or edited)."""


class TokenizerError(TokenloomError):
    """Text cannot be encoded (characters outside the vocabulary) or ids cannot be decoded."""


class VocabularyError(TokenizerError, DataError):
    """Text holds characters the tokenizer's vocabulary lacks: a tokenizer error, and a data error when the text came
    from a file (the readers prefix ``path:line``; a fine-tuning run adds the setting that fixed the tokenizer)."""


class GenerationError(TokenloomError, ValueError):
    """A generation request cannot be served (prompt too long, bad ids, bad settings)."""


class TrainingError(TokenloomError):
    """Training cannot go on (e.g. the loss or the gradients stayed non-finite); the last checkpoint is intact."""
