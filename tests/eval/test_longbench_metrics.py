"""LongBench's metrics against hand-computed values (Bai et al. 2023, arXiv 2308.14508)."""

from __future__ import annotations

import random
import sys

import pytest

from criticalkv.eval.longbench import scoring as lbm
from criticalkv.eval.longbench import segment
from criticalkv.eval.longbench.postprocess import first_line
from criticalkv.eval.longbench.similarity import fuzz_ratio, rouge_l
from criticalkv.eval.sample import Sample
from criticalkv.eval.tasks import bind_metric, char_credit, get_metric


def test_qa_f1_normalises_like_squad() -> None:
    assert lbm.normalize_answer("The  Saltwren!") == "saltwren"
    assert lbm.qa_f1_score("The Saltwren.", "Saltwren") == 1.0
    # pred {red, fox, jumped}, gold {red, fox}: P 2/3, R 1, F1 0.8
    assert lbm.qa_f1_score("a red fox jumped", "the red fox") == pytest.approx(0.8)
    assert lbm.qa_f1_score("blue", "red") == 0.0
    assert lbm.qa_f1_score("", "red") == 0.0


def test_rouge_l_is_the_rouge_packages_summary_level_f() -> None:
    # one sentence each: distinct words 5 and 5, LCS words {the, cat, on, mat}: P = R = 4/5
    assert rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(0.8)
    # two hypothesis sentences: union LCS {the, sat} | {the, dog} = 3 of ref's 3 words, of hyp's 5
    assert rouge_l("the cat sat. the dog ran", "the dog sat") == pytest.approx(2 * 0.6 / 1.6)
    with pytest.raises(ValueError, match="Hypothesis is empty"):
        rouge_l("...", "a")
    assert lbm.rouge_score("", "the cat") == 0.0  # the rouge package raises; LongBench scores 0
    assert lbm.rouge_score("the cat", "the cat") == pytest.approx(1.0)


def test_fuzz_ratio_and_code_similarity() -> None:
    # kitten / sitting: matching blocks "itt" and "n", 2 * 4 / 13 = 0.615 -> 62
    assert fuzz_ratio("kitten", "sitting") == 62
    assert fuzz_ratio("", "") == 100 and fuzz_ratio("", "x") == 0
    # the first line without ` # // is scored
    assert lbm.code_sim_score("```python\n# add them\n    return a + b\n", "    return a + b") == 1.0
    assert lbm.code_sim_score("// nothing\n", "x") == 0.0  # the empty last line is picked
    assert lbm.code_sim_score("\n\nkitten = 1", "sitting") == fuzz_ratio("kitten = 1", "sitting") / 100


def test_classification_keeps_longbenchs_remove_while_iterating() -> None:
    classes = ["LOC", "LOCATION", "NUM"]
    assert lbm.classification_score("LOCATION", "LOCATION", classes) == 1.0  # LOC is part of the gold: dropped
    assert lbm.classification_score("City or Country", "City", ["City", "Country", "Date"]) == 0.5
    assert lbm.classification_score("Date", "City", ["City", "Country", "Date"]) == 0.0
    # removing "A" shifts "AB" under the loop's index, so it is never examined: 1/2, not 1
    assert lbm.classification_score("ABC", "ABC", ["A", "AB", "ABC"]) == 0.5
    with pytest.raises(ValueError, match="all_classes"):
        lbm.classification_score("x", "x", [])


def test_retrieval_and_count() -> None:
    assert lbm.retrieval_score("Paragraph 2", "Paragraph 2") == 1.0
    assert lbm.retrieval_score("Paragraph 2 or Paragraph 3", "Paragraph 2") == 0.5
    assert lbm.retrieval_score("I do not know", "Paragraph 2") == 0.0
    assert lbm.retrieval_zh_score("答案是段落3", "段落3") == 1.0
    assert lbm.count_score("There are 3 unique paragraphs out of 4", "3") == 0.5
    assert lbm.count_score("three", "3") == 0.0
    with pytest.raises(ValueError, match="Paragraph"):
        lbm.retrieval_score("1", "the first one")


def test_zh_metrics_with_a_character_segmenter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lbm, "cut", list)  # one word per character
    assert lbm.normalize_zh_answer("木桥 和，茶园。") == "木桥和茶园"
    assert lbm.qa_f1_zh_score("木桥和茶园。", "木桥和茶园") == 1.0
    # 2 of the gold's 5 characters, all of the prediction's: F1 = 2 * 1 * 0.4 / 1.4
    assert lbm.qa_f1_zh_score("木桥", "木桥和茶园") == pytest.approx(0.8 / 1.4)
    # rouge over characters joined by spaces: distinct 4 vs 5, LCS {前, 端, 完, 成}
    assert lbm.rouge_zh_score("前端完成", "前端已完成") == pytest.approx(2 * (1 * 0.8) / 1.8)


def test_zh_metrics_with_jieba() -> None:
    pytest.importorskip("jieba")
    assert lbm.qa_f1_zh_score("我们今天开会", "今天我们开会") == 1.0
    assert lbm.rouge_zh_score("我们今天开会", "我们今天开会") == pytest.approx(1.0)


def test_missing_jieba_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jieba", None)  # import jieba -> ImportError
    segment.forget_jieba()
    try:
        with pytest.raises(segment.MissingJieba, match=r"pip install -e '\.\[longbench\]'"):
            lbm.qa_f1_zh_score("木桥", "木桥")
        assert lbm.qa_f1_score("a b", "a b") == 1.0  # the others do not need it
    finally:
        segment.forget_jieba()


def test_first_line_post_processing() -> None:
    assert first_line("\n\nCity\nQuestion: What is ...") == "City"
    assert first_line("") == ""


def _sample(metric: str, answers: list[str], **meta: object) -> Sample:
    return Sample("t", 0, "context", "question", answers, metric, 8, meta=dict(meta))


def test_bound_metrics_take_max_over_answers_classes_and_first_line() -> None:
    trec = bind_metric(_sample("classification_score", ["City"], all_classes=["City", "Date"], first_line=True))
    assert trec("\nCity\nQuestion: When ... Type: Date", ["City"]) == 1.0  # only the first line counts
    unprocessed = bind_metric(_sample("classification_score", ["City"], all_classes=["City", "Date"]))
    assert unprocessed("City\nDate", ["City"]) == 0.5
    qa = bind_metric(_sample("qa_f1_score", ["four", "4"]))
    assert qa("4 strings", ["four", "4"]) == pytest.approx(2 / 3)  # best answer: "4"
    ruler = bind_metric(_sample("string_match_all", ["123", "456"]))
    assert ruler("123", ["123", "456"]) == 0.5  # RULER metrics are unchanged
    with pytest.raises(ValueError, match="bind_metric"):
        get_metric("classification_score")


def test_char_credit_is_the_longest_common_substring() -> None:
    def brute(prediction: str, answer: str) -> float:
        pred, a, best = prediction.lower(), answer.lower(), 0
        for i in range(len(a)):
            for j in range(i + 1, len(a) + 1):
                if a[i:j] in pred:
                    best = max(best, j - i)
        return best / max(len(a), 1)

    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("abAc1") for _ in range(rng.randint(0, 10)))
        p = "".join(rng.choice("abcC12") for _ in range(rng.randint(0, 12)))
        assert char_credit(p, [a]) == pytest.approx(brute(p, a))
