"""LongBench's metrics (``metrics.py``, Bai et al. 2023, arXiv 2308.14508), re-implemented.

Each scorer takes ``(prediction, ground_truth, all_classes)`` for one reference answer, as
LongBench's do; a sample's score is the maximum over its answers, after the first-line
post-processing of the few-shot datasets (:func:`bind`). ``rouge`` and ``fuzzywuzzy`` are
replaced by :mod:`~criticalkv.eval.longbench.similarity`; jieba (Chinese) is optional
(:mod:`~criticalkv.eval.longbench.segment`).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from criticalkv.eval.longbench.postprocess import first_line
from criticalkv.eval.longbench.segment import cut
from criticalkv.eval.longbench.similarity import fuzz_ratio, rouge_l

if TYPE_CHECKING:
    from criticalkv.eval.sample import Sample

Scorer = Callable[[str, str, Sequence[str]], float]

_PUNCT = frozenset(string.punctuation)
# LongBench's Chinese punctuation
_ZH_PUNCT = frozenset(
    string.punctuation
    + "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［"
    + "＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔"
    + "〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower case, drop ASCII punctuation, the articles a/an/the and extra whitespace (SQuAD's)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(text: str) -> str:
    """Lower case, drop ASCII and Chinese punctuation and all whitespace."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ZH_PUNCT).split())


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """Token-multiset F1."""
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = ()) -> float:
    """F1 over the words of the normalised texts."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = ()) -> float:
    """F1 over jieba words, each normalised, empty ones dropped."""

    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(t) for t in cut(text)) if w]

    return f1_score(words(prediction), words(ground_truth))


def rouge_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = ()) -> float:
    """ROUGE-L F; 0 when the rouge package would raise (an empty text)."""
    try:
        return rouge_l(prediction, ground_truth)
    except ValueError:
        return 0.0


def rouge_zh_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = ()) -> float:
    """ROUGE-L F over jieba words joined by spaces."""
    return rouge_score(" ".join(cut(prediction)), " ".join(cut(ground_truth)))


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = ()) -> float:
    """1 / (number of classes named) if the gold class is among the classes named in the
    prediction, else 0; a named class that is a proper substring of the gold one is not counted.

    Faithful to LongBench, which removes from the list while iterating over it, so the class
    right after a removed one is not examined.
    """
    if not all_classes:
        raise ValueError("classification_score needs the dataset's all_classes")
    named = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(named):  # the for-loop-with-remove of LongBench, step by step
        term = named[i]
        if term in ground_truth and term != ground_truth:
            named.remove(term)
        i += 1
    return 1.0 / len(named) if ground_truth in named else 0.0


def _share_of(numbers: list[str], target: str) -> float:
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def _paragraph_id(ground_truth: str, pattern: str) -> str:
    found = re.findall(pattern, ground_truth)
    if not found:
        raise ValueError(f"reference {ground_truth!r} does not match LongBench's {pattern!r}")
    return str(found[0])


def retrieval_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = ()) -> float:
    """Share of the numbers in the prediction equal to the gold ``Paragraph N``."""
    return _share_of(re.findall(r"\d+", prediction), _paragraph_id(ground_truth, r"Paragraph (\d+)"))


def retrieval_zh_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = ()) -> float:
    """Share of the numbers in the prediction equal to the gold ``段落N``."""
    return _share_of(re.findall(r"\d+", prediction), _paragraph_id(ground_truth, r"段落(\d+)"))


def count_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = ()) -> float:
    """Share of the numbers in the prediction equal to the gold count."""
    return _share_of(re.findall(r"\d+", prediction), str(ground_truth))


def code_sim_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = ()) -> float:
    """Fuzzy ratio / 100 between the gold line and the prediction's first line that holds no
    ``` ` ```, ``#`` or ``//`` (none: the empty string)."""
    line = next((x for x in prediction.lstrip("\n").split("\n") if "`" not in x and "#" not in x and "//" not in x), "")
    return fuzz_ratio(line, ground_truth) / 100


#: every LongBench metric, by LongBench's function name
SCORERS: dict[str, Scorer] = {
    "qa_f1_score": qa_f1_score,
    "qa_f1_zh_score": qa_f1_zh_score,
    "rouge_score": rouge_score,
    "rouge_zh_score": rouge_zh_score,
    "classification_score": classification_score,
    "retrieval_score": retrieval_score,
    "retrieval_zh_score": retrieval_zh_score,
    "count_score": count_score,
    "code_sim_score": code_sim_score,
}


def score(
    metric: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] = (), first: bool = False
) -> float:
    """A sample's score: ``max(0, max over answers)`` of ``metric``, on the first line if ``first``."""
    if metric not in SCORERS:
        raise ValueError(f"unknown LongBench metric {metric!r}; choose from: {', '.join(SCORERS)}")
    if first:
        prediction = first_line(prediction)
    scorer = SCORERS[metric]
    return max([0.0, *(scorer(prediction, gt, all_classes) for gt in answers)])


def bind(sample: Sample) -> Callable[[str, Sequence[str]], float]:
    """The ``(prediction, answers) -> score`` function of a LongBench sample: its metric with
    the sample's ``all_classes`` and first-line post-processing (``meta``) bound in."""
    metric = sample.metric
    if metric not in SCORERS:
        raise ValueError(f"unknown LongBench metric {metric!r}; choose from: {', '.join(SCORERS)}")
    classes = tuple(sample.meta.get("all_classes") or ())
    first = bool(sample.meta.get("first_line", False))

    def scored(prediction: str, answers: Sequence[str]) -> float:
        return score(metric, prediction, answers, classes, first)

    return scored
