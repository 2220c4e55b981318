"""The words retrieval and checking compare: :func:`terms` (BM25's tokens) and :func:`content_terms` (the fact
check's and the citations': the terms less a short list of function words).

A term is a maximal run of Unicode word characters (``\\w+``: letters, digits, underscore), lowercased; nothing is
stemmed. The same function reads documents and queries, and it depends on no model tokenizer, so one index serves any
model.
"""

from __future__ import annotations

import re

WORD = re.compile(r"\w+")
# function words: articles, pronouns, auxiliaries, prepositions and conjunctions (they carry no claim of their own)
STOPWORDS = frozenset("""
a an the this that these those it its he she they them their his her him we us our you your i me my
is are was were be been being am do does did done has have had having will would shall should can could may might
must of in on at to for from by with about as into onto over under between through during before after above below
and or but nor not no so than then too very also just only if else when where which who whom whose what why how
there here all any both each few more most other some such own same s t don isn
""".split())


def terms(text: str) -> list[str]:
    """The lowercased word tokens of ``text`` (``\\w+`` runs), in order, repeats kept: BM25's tokenisation."""
    return WORD.findall(text.lower())


def content_terms(text: str) -> list[str]:
    """:func:`terms` less :data:`STOPWORDS` (in order, repeats kept)."""
    return [t for t in terms(text) if t not in STOPWORDS]
