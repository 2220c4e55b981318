"""Shared pieces of the property fuzzers: edge-case numbers, YAML-shaped values, the one-line-error check."""

from __future__ import annotations

import math
import re
import sys

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from tokenloom.errors import TokenloomError

F32_TINY = 1.401298464324817e-45  # the smallest float32 subnormal
F32_MIN_NORMAL = 1.1754943508222875e-38
F32_MAX = 3.4028234663852886e38
EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-320, sys.float_info.min, 1e-300, 1e-100, F32_TINY / 2, F32_TINY, 1e-44,
               1e-39, math.nextafter(F32_MIN_NORMAL, 0), F32_MIN_NORMAL, 1e-30, 1e-7, 0.5, 1.0, 1.5, 2.0,
               1e30, F32_MAX, 3.5e38, 1e300, sys.float_info.max, math.inf, -math.inf, math.nan, -1e-300, -1.0,
               -F32_MAX, -sys.float_info.max]
EDGE_INTS = [0, 1, 2, -1, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, -(2 ** 63), -(2 ** 63) - 1,
             2 ** 64 - 1, 2 ** 64, 2 ** 64 + 1, 2 ** 100, -(2 ** 100), 10 ** 400]

# any float (nan, inf, subnormals included), leaning on the values where float32/bf16 arithmetic breaks
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True))
# 10^5000 has more digits than str() converts (Python's 4300-digit limit): an error message quoting it must not fail
huge_int = st.sampled_from([5000, -5000]).map(lambda digits: 10 ** abs(digits) * (1 if digits > 0 else -1))
ints = st.one_of(st.sampled_from(EDGE_INTS), huge_int, st.integers())
weird_text = st.one_of(
    st.sampled_from(["", " ", "\x00", "\n", "null", "~", "yes", "on", "1e-4", "nan", ".inf", "0x10", "1_000",
                     "\ud800", "\U0010ffff", "é", "‮", "a" * 300, "!!python/object/apply:os.system ['true']"]),
    st.text(max_size=20))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, weird_text)
# YAML-shaped values: scalars, lists and string-keyed mappings of them, nested
yaml_values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)), max_leaves=12)


def assert_one_line(err: BaseException) -> None:
    """``err`` is a user error whose message is one non-empty line (what the CLI prints); or, for a config with
    several problems (:class:`ConfigProblems`, also quoted by another error), a header line ending in ``N problems
    in <where>:`` and N indented ``  - `` lines, one per problem."""
    assert isinstance(err, TokenloomError), f"{type(err).__name__} is not a TokenloomError: {err!r}"
    text = str(err)
    assert text.strip() and "\r" not in text, f"not one line: {text!r}"
    if "\n" in text:
        header, *lines = text.split("\n")
        count = re.search(r"(\d+) problems in .*:$", header)
        assert count and int(count.group(1)) == len(lines) >= 2, f"not one line nor a list of problems: {text!r}"
        assert all(line.startswith("  - ") and line[4:].strip() for line in lines), f"not one line each: {text!r}"


def note(text: str) -> None:
    """``hypothesis.event`` (the statistics of ``--hypothesis-show-statistics``), also callable outside a test."""
    if currently_in_test_context():
        event(text)
