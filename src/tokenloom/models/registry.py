"""``MODELS``: model families by name (``gpt``, ``seq2seq``, ``nat``, ``vit``, ``swin``), each a (config class,
model class) pair so a checkpoint's ``config.yaml`` can name its family.

``DECODERS``: how a model class decodes, declared once where the class is defined and never probed with
``hasattr``: ``causal_lm`` (one token at a time from a prompt: generate, beam search, the serving engine),
``encoder_decoder`` (autoregressive over an encoded source: translate, beam search), ``parallel`` (all target
positions at once: NAT, Mask-Predict, CTC) and ``semi_autoregressive`` (K target tokens per step: semi_ar).
Classes that cannot decode (image classifiers) declare nothing::

    @declare_decoding("causal_lm")
    class GPT(nn.Module): ...

    decoding_of(model)  # "causal_lm"; a subclass inherits its base's kind unless it declares its own

Pondering (adaptive computation time), declared the same way: a class declared with ``@declare_ponder`` offers
``ponder_cost`` (tau, a float) and ``forward_ponder``, in the form of its decoding kind: a causal LM's
``forward_ponder(input_ids, *, positions=, attention_mask=, cache=) -> (logits (B, T, V), ponder (B, T))`` (the
ponder count N + R of each position), and the language-modelling task trains on
``cross_entropy + ponder_cost * ponder.mean()``; an encoder-decoder's ``forward_ponder(source, target_in,
source_mask) -> (logits (B, T, V), ponder (B, S))`` and ``encode_ponder(source, source_mask) -> (memory, ponder)``
(the ponder of each source position, 0 at padding), and the translation task adds ``ponder_cost`` times the mean
over the real source positions. ``ponders(model)`` says whether a model does::

    @declare_ponder
    @declare_decoding("causal_lm")
    class UniversalTransformer(nn.Module): ...

    ponders(model)  # True; also for a wrapper holding the model as ``.model`` (train.compile's forward)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..registry import Registry

MODELS: Registry[tuple[type, type]] = Registry("model")

DECODERS: Registry[str] = Registry("decoding kind")  # kind -> what it means
DECODERS.register("causal_lm")("one token at a time after a prompt (generate, beam search, the serving engine)")
DECODERS.register("encoder_decoder")("autoregressive over an encoded source (translate, beam search)")
DECODERS.register("parallel")("every target position at once (NAT, Mask-Predict, CTC)")
DECODERS.register("semi_autoregressive")("K tokens per step over an encoded source (semi-autoregressive translate)")
_DECLARED: dict[type, str] = {}  # model class -> its kind

M = TypeVar("M", bound=type)


def declare_decoding(kind: str) -> Callable[[M], M]:
    """Class decorator: ``cls`` (and its subclasses, unless they declare their own) decodes as ``kind``."""
    DECODERS.get(kind)  # an unknown kind: its one-line error, at import

    def deco(cls: M) -> M:
        _DECLARED[cls] = kind
        return cls

    return deco


def decoding_of(model_or_class: object) -> str | None:
    """The decoding kind of a model (instance or class): the nearest declaration along its MRO, or None for a
    model that does not decode."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    for base in cls.__mro__:
        if base in _DECLARED:
            return _DECLARED[base]
    return None


_PONDERS: set[type] = set()  # model classes that return a ponder count (ACT)


def declare_ponder(cls: M) -> M:
    """Class decorator: ``cls`` (and its subclasses) offers ``forward_ponder`` and ``ponder_cost`` (see above)."""
    _PONDERS.add(cls)
    return cls


def ponders(model_or_class: object) -> bool:
    """Whether a model (instance or class) was declared with :func:`declare_ponder`, along its MRO; an object that
    is not a declared model but holds one in its ``model`` attribute (the Trainer's compiled forward, which passes
    attribute access on to the model) answers for that model."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    if any(base in _PONDERS for base in cls.__mro__):
        return True
    inner = getattr(model_or_class, "__dict__", {}).get("model")
    return inner is not None and inner is not model_or_class and ponders(inner)


_PACKS: set[type] = set()  # model classes whose whole-sequence forward takes ``documents`` (packed examples)


def declare_documents(cls: M) -> M:
    """Class decorator: ``cls`` (and its subclasses) takes ``documents`` (B, T) -- the example id of each position of
    packed rows, 0 = padding -- in its whole-sequence ``forward`` / ``forward_features``: attention stays inside an
    example and positions restart with each (sequence packing for fine-tuning)."""
    _PACKS.add(cls)
    return cls


def takes_documents(model_or_class: object) -> bool:
    """Whether a model (instance or class; or a wrapper holding one as ``model``) was declared with
    :func:`declare_documents`."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    if any(base in _PACKS for base in cls.__mro__):
        return True
    inner = getattr(model_or_class, "__dict__", {}).get("model")
    return inner is not None and inner is not model_or_class and takes_documents(inner)
