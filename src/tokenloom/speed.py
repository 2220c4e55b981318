"""Speed figures of one piece of work (a generation, a file of translations, an evaluation pass, a served request),
measured around the work itself (model loading apart), and their one text form: the ``--verbose`` lines of
``tokenloom generate | translate | evaluate`` (:func:`speed_lines`) and the per-request log line of ``tokenloom serve
--verbose`` (:func:`speed_line`). Both render the same parts (:func:`speed_parts`)::

    load: 0.41 s (before the work, not counted below)
    prompt: 6 tokens, first token after 4.2 ms (1,429 tokens/s)
    decode: 40 new tokens, 39 after the first in 0.31 s (125.8 tokens/s, 7.95 ms/token)
    speculative: draft model D, k = 4: 12 passes of the model, 28 of 44 drafts kept (acceptance 0.64), ...
    total: 0.32 s (125.0 new tokens/s end to end)

Nothing here measures: the callers time the work and fill in :class:`Speed`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Speed:
    """What a run did and how long it took; a figure left None is not known to the caller and not printed."""

    seconds: float  # wall time of the work: from the first input token in to the last new token out
    new_tokens: int | None = None  # tokens generated (each one the model produced, an end-of-sequence token too)
    prompt_tokens: int | None = None  # tokens read before the first new one (translate: the sources')
    prompt_name: str = "prompt"  # what the prompt is called in the text ("sources" for translate)
    first_token_seconds: float | None = None  # time to the first new token (the prompt's prefill; serve: from the
    #   request's arrival at the engine, queueing included); None: not measured apart (beam search, batches)
    prompts: int = 1  # prompts decoded one after another (generate --num-samples): the first token of each came out
    #   of its prompt's pass, and first_token_seconds adds up their times
    scored_tokens: int | None = None  # evaluate: tokens scored (teacher-forced, nothing generated)
    sentences: int | None = None  # translate: sentences translated
    decoding: str | None = None  # "greedy", "beam 5", ... (translate, generate --beam)
    load_seconds: float | None = None  # loading the model(s) and tokenizer, before the work
    drafted: int | None = None  # speculative decoding: draft tokens verified by the model
    accepted: int | None = None  # of those, the ones the model kept
    passes: int | None = None  # speculative decoding: verification passes of the model
    rows: int | None = None  # rows verified over those passes (each live row of each pass)
    emitted: int | None = None  # tokens those passes produced
    drafter: str | None = None  # "draft model RUN, k = 4", "prompt lookup (n <= 3), k = 4"


def duration(seconds: float) -> str:
    """``4.2 ms`` under a second, ``1.52 s`` from there."""
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def rate(count: int, seconds: float, unit: str) -> str:
    """``125.8 tokens/s, 7.95 ms/token``: a count over a time, and the time per item (nothing for a zero time)."""
    if count <= 0 or seconds <= 0:
        return f"no {unit}s timed" if count <= 0 else "too fast to time"
    return f"{count / seconds:,.1f} {unit}s/s, {seconds * 1e3 / count:.2f} ms/{unit}"


def draft_text(drafted: int, accepted: int, passes: int | None = None, rows: int | None = None,
               emitted: int | None = None) -> str:
    """``12 passes of the model, 28 of 44 drafts kept (acceptance 0.64), 2.33 kept and 3.33 tokens per pass``
    (the parts whose numbers are given)."""
    rate_ = f"{accepted / drafted:.2f}" if drafted else "n/a"
    text = f"{accepted} of {drafted} drafts kept (acceptance {rate_})"
    if passes is not None:
        text = f"{passes} passes of the model, {text}"
    if rows and emitted is not None:
        text += f", {accepted / rows:.2f} kept and {emitted / rows:.2f} tokens per pass"
    return text


def speed_parts(speed: Speed) -> list[tuple[str, str]]:
    """(label, text) per figure known, in the order the work ran."""
    parts = []
    if speed.load_seconds is not None:
        parts.append(("load", f"{duration(speed.load_seconds)} (before the work, not counted below)"))
    if speed.sentences is not None:
        how = f", {speed.decoding}" if speed.decoding else ""
        per = f"{speed.sentences / speed.seconds:,.1f} sentences/s" if speed.seconds > 0 else "too fast to time"
        parts.append(("sentences", f"{speed.sentences:,} in {duration(speed.seconds)} ({per}{how})"))
    if speed.prompt_tokens is not None:
        text = f"{speed.prompt_tokens:,} tokens"
        if speed.first_token_seconds is not None and speed.prompts > 1:
            text += f" ({speed.prompts} prompts), first tokens after {duration(speed.first_token_seconds)} in all"
        elif speed.first_token_seconds is not None:
            text += f", first token after {duration(speed.first_token_seconds)}"
        if speed.first_token_seconds:  # the prompts' tokens over the time to their first tokens
            text += f" ({speed.prompt_tokens / speed.first_token_seconds:,.0f} tokens/s)"
        parts.append((speed.prompt_name, text))
    if speed.scored_tokens is not None:
        parts.append(("score", f"{speed.scored_tokens:,} tokens in {duration(speed.seconds)} "
                               f"({rate(speed.scored_tokens, speed.seconds, 'token')})"))
    if speed.new_tokens is not None:
        n, ttft = speed.new_tokens, speed.first_token_seconds
        how = f" ({speed.decoding})" if speed.decoding and speed.sentences is None else ""
        first = speed.prompts
        if ttft is not None and n > first:  # the first tokens came out of the prompts' passes: the rest are steps
            after = max(speed.seconds - ttft, 0.0)
            which = "the first" if first == 1 else f"the first of each of {first} prompts"
            text = (f"{n:,} new tokens{how}, {n - first:,} after {which} in {duration(after)} "
                    f"({rate(n - first, after, 'token')})")
        elif ttft is not None or n == 0:
            text = f"{n:,} new token{'' if n == 1 else 's'}{how}"
        else:
            text = f"{n:,} new tokens{how} in {duration(speed.seconds)} ({rate(n, speed.seconds, 'token')})"
        parts.append(("decode", text))
    if speed.drafted is not None:
        head = f"{speed.drafter}: " if speed.drafter else ""
        parts.append(("speculative", head + draft_text(speed.drafted, speed.accepted or 0, speed.passes,
                                                       speed.rows, speed.emitted)))
    total = duration(speed.seconds)
    if speed.new_tokens and speed.seconds > 0 and speed.first_token_seconds is not None:
        total += f" ({speed.new_tokens / speed.seconds:,.1f} new tokens/s end to end)"
    parts.append(("total", total))
    return parts


def speed_lines(speed: Speed) -> list[str]:
    """The ``--verbose`` lines of a command: ``label: text`` each."""
    return [f"{label}: {text}" for label, text in speed_parts(speed)]


def speed_line(speed: Speed, head: str) -> str:
    """One line (a served request's log line): ``head: label text | label text | ...``."""
    return f"{head}: " + " | ".join(f"{label} {text}" for label, text in speed_parts(speed))
