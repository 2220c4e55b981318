"""The kinds of non-autoregressive model, one file each: ``nat`` (:mod:`.nat`), ``cmlm`` (:mod:`.cmlm`), ``ctc``
(:mod:`.ctc`), ``levenshtein`` (:mod:`.levenshtein`), ``insertion`` (:mod:`.insertion`); glancing training for the
single-pass kinds in :mod:`.glancing`.

``NAT_KINDS`` maps ``NATConfig.kind`` to a :class:`~.base.NATKind` strategy (see :mod:`.base` for what one
provides). Every module of this package is imported with it, so a new kind is one file here that subclasses
``NATKind`` and registers an instance, ``NAT_KINDS.register("name")(MyKind())`` (plus, only when none of
``argmax`` / ``mask_predict`` / ``ctc`` / ``levenshtein`` / ``insertion`` fits, a decoding registered in
:data:`tokenloom.generation.parallel.NAT_DECODINGS`). A kind registered from elsewhere (a test, a plugin) works alike.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import DECODING_OPTIONS, NAT_KINDS, NATKind, ReadsTokens, decoding_options, token_cross_entropy


def load_kind_files() -> None:
    """Import every module of this package (each registers its kind)."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


load_kind_files()

__all__ = ["DECODING_OPTIONS", "NAT_KINDS", "NATKind", "ReadsTokens", "decoding_options", "load_kind_files",
           "token_cross_entropy"]
