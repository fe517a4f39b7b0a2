"""Pure-Python re-implementations of the two text similarities LongBench imports.

* :func:`rouge_l` -- the ``rouge`` package's (pltrdy/rouge 1.0.1) ``rouge-l`` ``"f"``, which
  LongBench's ``rouge_score`` returns: summary-level union LCS over sentences split on ``"."``.
  Reproduced with its quirks: words are ``str.split(" ")`` of whitespace-normalised sentences,
  and with the package's default ``exclusive=True`` the word counts and the union of LCS words
  are *sets* (distinct words). The LCS is computed iteratively; the package rebuilds it by
  recursion, which can exceed Python's recursion limit on very long single sentences (Chinese
  summaries have no ``"."``), where LongBench's bare ``except`` scores 0 -- we score such pairs.
* :func:`fuzz_ratio` -- ``fuzzywuzzy.fuzz.ratio`` without python-Levenshtein (LongBench's
  requirements), i.e. ``round(100 * difflib.SequenceMatcher(None, a, b).ratio())``.
"""

from __future__ import annotations

from difflib import SequenceMatcher


def _sentences(text: str) -> list[list[str]]:
    """The rouge package's split: on ``"."``, non-empty pieces, whitespace-normalised, ``split(" ")``."""
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if len(piece) > 0]


def _lcs_words(ref: list[str], hyp: list[str]) -> set[str]:
    """Distinct words of the LCS of ``ref`` and ``hyp``, traced back as the rouge package does."""
    n, m = len(ref), len(hyp)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        row, prev, word = table[i], table[i - 1], ref[i - 1]
        for j in range(1, m + 1):
            row[j] = prev[j - 1] + 1 if word == hyp[j - 1] else max(prev[j], row[j - 1])
    words: set[str] = set()
    i, j = n, m
    while i > 0 and j > 0:
        if ref[i - 1] == hyp[j - 1]:
            words.add(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l(hypothesis: str, reference: str) -> float:
    """ROUGE-L F (summary level) of ``hypothesis`` against ``reference``, as the ``rouge`` package.

    Raises ``ValueError`` when either text has no sentence (the package's "Hypothesis is empty").
    """
    hyp, ref = _sentences(hypothesis), _sentences(reference)
    if not hyp:
        raise ValueError("Hypothesis is empty.")
    if not ref:
        raise ValueError("Reference is empty.")
    m = len({w for s in ref for w in s})
    n = len({w for s in hyp for w in s})
    union: set[str] = set()
    for r in ref:
        for h in hyp:
            union |= _lcs_words(r, h)
    recall, precision = len(union) / m, len(union) / n
    return 2.0 * ((precision * recall) / (precision + recall + 1e-8))


def fuzz_ratio(a: str, b: str) -> int:
    """``fuzzywuzzy.fuzz.ratio``: 100 for equal strings, 0 if either is empty, else the rounded
    ``100 * SequenceMatcher(None, a, b).ratio()``."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return round(100 * SequenceMatcher(None, a, b).ratio())
