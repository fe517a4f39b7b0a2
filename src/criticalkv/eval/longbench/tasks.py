"""LongBench's 21 datasets: prompt templates, generation lengths, metrics and chat handling.

LongBench (Bai et al. 2023, arXiv 2308.14508). The templates (``config/dataset2prompt.json``),
generation lengths (``config/dataset2maxlen.json``), the datasets run without a chat template
(``pred.py``), the metric of each dataset and the datasets scored on their first line
(``eval.py``) are LongBench's, verbatim (including the template typo "asconcisely").

Every template has exactly one ``{context}`` and, where it has one, ``{input}`` after it, so the
split that question-agnostic compression needs is the template's own: the *context part* is the
template up to ``{context}`` plus the context, the *question part* everything after the context
with ``{input}`` filled in. Datasets without ``{input}`` (``gov_report``, ``multi_news``,
``vcsum``, ``passage_count``, ``lcc``) have only the closing instruction as question part; for
``repobench-p`` the question part is the in-file code (``input``), the context the cross-file code.
"""

from __future__ import annotations

from collections.abc import Iterable

#: the 21 LongBench (v1) datasets, in LongBench's order
DATASETS: tuple[str, ...] = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "multifieldqa_zh",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "dureader",
    "gov_report",
    "qmsum",
    "multi_news",
    "vcsum",
    "trec",
    "triviaqa",
    "samsum",
    "lsht",
    "passage_count",
    "passage_retrieval_en",
    "passage_retrieval_zh",
    "lcc",
    "repobench-p",
)
#: the 13 datasets LongBench-E has (files ``{name}_e.jsonl``)
E_DATASETS: tuple[str, ...] = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
#: the five Chinese datasets
ZH_DATASETS: tuple[str, ...] = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
#: the 16 English and code datasets, the set the CriticalKV and AdaKV papers report
EN_DATASETS: tuple[str, ...] = tuple(d for d in DATASETS if d not in ZH_DATASETS)
#: task groups ``--tasks`` accepts besides dataset names
GROUPS = ("all", "en", "zh")

#: datasets LongBench prompts without the chat template ("chat models are better off without")
NO_CHAT: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
#: few-shot datasets whose prediction is scored on its first line only
FIRST_LINE: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})

#: maximum new tokens per dataset (``dataset2maxlen.json``)
MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

#: the metric of each dataset (``eval.py``'s ``dataset2metric``), by the names of
#: :mod:`criticalkv.eval.longbench.metrics`
METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1_score",
    "qasper": "qa_f1_score",
    "multifieldqa_en": "qa_f1_score",
    "multifieldqa_zh": "qa_f1_zh_score",
    "hotpotqa": "qa_f1_score",
    "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score",
    "dureader": "rouge_zh_score",
    "gov_report": "rouge_score",
    "qmsum": "rouge_score",
    "multi_news": "rouge_score",
    "vcsum": "rouge_zh_score",
    "trec": "classification_score",
    "triviaqa": "qa_f1_score",
    "samsum": "rouge_score",
    "lsht": "classification_score",
    "passage_count": "count_score",
    "passage_retrieval_en": "retrieval_score",
    "passage_retrieval_zh": "retrieval_zh_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}

#: the prompt template of each dataset (``dataset2prompt.json``)
PROMPTS: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. "
        "Answer the question asconcisely as you can, using a single phrase if possible. Do not "
        "provide any explanation.\n"
        "\n"
        "Story: {context}\n"
        "\n"
        "Now, answer the question based on the story asconcisely as you can, using a single phrase "
        "if possible. Do not provide any explanation.\n"
        "\n"
        "Question: {input}\n"
        "\n"
        "Answer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as "
        "you can, using a single phrase or sentence if possible. If the question cannot be "
        'answered based on the information in the article, write "unanswerable". If the question '
        'is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n'
        "\n"
        "Article: {context}\n"
        "\n"
        " Answer the question based on the above article as concisely as you can, using a single "
        "phrase or sentence if possible. If the question cannot be answered based on the "
        'information in the article, write "unanswerable". If the question is a yes/no question, '
        'answer "yes", "no", or "unanswerable". Do not provide any explanation.\n'
        "\n"
        "Question: {input}\n"
        "\n"
        "Answer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n"
        "\n"
        "{context}\n"
        "\n"
        "Now, answer the following question based on the above text, only give me the answer and "
        "do not output any other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n"
        "\n"
        "{context}\n"
        "\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n"
        "\n"
        "问题：{input}\n"
        "回答："
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n"
        "\n"
        "The following are given passages.\n"
        "{context}\n"
        "\n"
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n"
        "\n"
        "The following are given passages.\n"
        "{context}\n"
        "\n"
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n"
        "\n"
        "The following are given passages.\n"
        "{context}\n"
        "\n"
        "Answer the question based on the given passages. Only give me the answer and do not "
        "output any other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n"
        "\n"
        "Report:\n"
        "{context}\n"
        "\n"
        "Now, write a one-page summary of the report.\n"
        "\n"
        "Summary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. "
        "Answer the query in one or more sentences.\n"
        "\n"
        "Transcript:\n"
        "{context}\n"
        "\n"
        "Now, answer the query based on the above meeting transcript in one or more sentences.\n"
        "\n"
        "Query: {input}\n"
        "Answer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n"
        "\n"
        "News:\n"
        "{context}\n"
        "\n"
        "Now, write a one-page summary of all the news.\n"
        "\n"
        "Summary:"
    ),
    "vcsum": ("下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结："),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output "
        "any other words. The following are some examples.\n"
        "\n"
        "{context}\n"
        "\n"
        "{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "lsht": ("请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}"),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. "
        "Please carefully read these paragraphs and determine how many unique paragraphs there are "
        "after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n"
        "\n"
        "{context}\n"
        "\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output "
        "format should only contain the number, such as 1, 2, 3, and so on.\n"
        "\n"
        "The final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
        "paragraph the abstract is from.\n"
        "\n"
        "{context}\n"
        "\n"
        "The following is an abstract.\n"
        "\n"
        "{input}\n"
        "\n"
        "Please enter the number of the paragraph that the abstract is from. The answer format "
        'must be like "Paragraph 1", "Paragraph 2", etc.\n'
        "\n"
        "The answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n"
        "\n"
        "{context}\n"
        "\n"
        "下面是一个摘要\n"
        "\n"
        "{input}\n"
        "\n"
        '请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n'
        "\n"
        "答案是："
    ),
    "lcc": ("Please complete the code given below. \n{context}Next line of code:\n"),
    "repobench-p": ("Please complete the code given below. \n{context}{input}Next line of code:\n"),
}


def split_template(dataset: str, question_input: str) -> tuple[str, str]:
    """(head, tail) of a dataset's prompt around ``{context}``, with ``{input}`` filled into the tail."""
    if dataset not in PROMPTS:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; choose from: {', '.join(DATASETS)}")
    head, tail = PROMPTS[dataset].split("{context}")
    return head, tail.replace("{input}", question_input)


def resolve_tasks(spec: str | Iterable[str], longbench_e: bool = False) -> list[str]:
    """Dataset names from ``--tasks``: names and the groups ``all``, ``en`` (the 16 English and
    code datasets) and ``zh``, comma-separated or as a list; duplicates dropped, order kept.

    With ``longbench_e`` only LongBench-E's 13 datasets are allowed (``all`` and ``en`` mean those).
    """
    parts = [p.strip() for p in (spec.split(",") if isinstance(spec, str) else spec) if p.strip()]
    if not parts:
        raise ValueError("no LongBench tasks given")
    allowed = E_DATASETS if longbench_e else DATASETS
    out: list[str] = []
    for part in parts:
        if part == "all":
            names: Iterable[str] = allowed
        elif part == "en":
            names = [d for d in EN_DATASETS if d in allowed]
        elif part == "zh":
            names = [d for d in ZH_DATASETS if d in allowed]
            if not names:
                raise ValueError("LongBench-E has no Chinese datasets; drop 'zh' or --longbench-e")
        else:
            name = part.removesuffix("_e") if longbench_e else part
            if name not in allowed:
                which = "LongBench-E" if longbench_e else "LongBench"
                raise ValueError(
                    f"unknown {which} task {part!r}; choose from: {', '.join(allowed)} (or {', '.join(GROUPS)})"
                )
            names = [name]
        out += [n for n in names if n not in out]
    return out
