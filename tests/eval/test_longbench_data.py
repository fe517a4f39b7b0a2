"""LongBench data: the loader's two paths, templates, middle truncation, samples, sweep config."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Regex, decoders, pre_tokenizers

from criticalkv.eval.longbench import buckets, loader, segment, tasks
from criticalkv.eval.longbench.samples import make_sample
from criticalkv.eval.longbench.truncation import middle_truncate
from criticalkv.eval.sample import encode_sample
from criticalkv.eval.sweep import SweepConfig
from tests.helpers.tiny_tokenizer import char_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "longbench"


def exact_char_tokenizer() -> Any:
    """The tests' character tokenizer with newlines as tokens and decoding that joins characters."""
    tok = char_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.backend_tokenizer.decoder = decoders.Fuse()
    return tok


@pytest.fixture(scope="module")
def tok() -> Any:
    return exact_char_tokenizer()


@pytest.fixture
def no_jieba(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setitem(sys.modules, "jieba", None)
    segment.forget_jieba()
    yield
    segment.forget_jieba()


def test_every_dataset_has_a_template_a_length_a_metric_and_a_fixture() -> None:
    assert len(tasks.DATASETS) == 21 and len(tasks.EN_DATASETS) == 16 and len(tasks.E_DATASETS) == 13
    for name in tasks.DATASETS:
        template = tasks.PROMPTS[name]
        assert template.count("{context}") == 1 and template.count("{input}") <= 1
        assert "{input}" not in template.split("{context}")[0]  # the question always follows the context
        assert tasks.MAX_NEW_TOKENS[name] in (32, 64, 128, 512) and tasks.METRIC[name].endswith("_score")
        records = loader.load_records(name, FIXTURES)
        assert records and all(r.dataset == name for r in records)
    for name in ("hotpotqa", "passage_count"):
        assert loader.load_records(name, FIXTURES, longbench_e=True)
    assert {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"} == tasks.NO_CHAT
    assert {"trec", "triviaqa", "samsum", "lsht"} == tasks.FIRST_LINE


def test_resolve_tasks_groups_and_errors() -> None:
    assert tasks.resolve_tasks("all") == list(tasks.DATASETS)
    assert tasks.resolve_tasks("en,trec") == list(tasks.EN_DATASETS)
    assert tasks.resolve_tasks(["trec", "zh"]) == ["trec", *tasks.ZH_DATASETS]
    assert tasks.resolve_tasks("all", longbench_e=True) == list(tasks.E_DATASETS)
    assert tasks.resolve_tasks("qasper_e", longbench_e=True) == ["qasper"]
    with pytest.raises(ValueError, match="unknown LongBench task 'nope'"):
        tasks.resolve_tasks("nope")
    with pytest.raises(ValueError, match="unknown LongBench-E task 'narrativeqa'"):
        tasks.resolve_tasks("narrativeqa", longbench_e=True)
    with pytest.raises(ValueError, match="no Chinese"):
        tasks.resolve_tasks("zh", longbench_e=True)


def test_records_keep_every_field(tmp_path: Path) -> None:
    (trec,) = loader.load_records("trec", FIXTURES, limit=1)
    assert trec.index == 0 and trec.answers == ["City"] and trec.language == "en" and trec.id == "trec-0"
    assert trec.all_classes and "City" in trec.all_classes and trec.input.endswith("Type:")
    # the unpacked data.zip layout (DIR/data/*.jsonl) is found too
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "lcc.jsonl").write_text((FIXTURES / "lcc.jsonl").read_text())
    assert loader.load_records("lcc", tmp_path) == loader.load_records("lcc", FIXTURES)


def test_malformed_rows_name_the_file_and_line(tmp_path: Path) -> None:
    good = (FIXTURES / "hotpotqa.jsonl").read_text().splitlines()[0]
    row = json.loads(good)
    cases = {
        "{not json": "not JSON",
        json.dumps({**row, "answers": "Aarhus"}): "list of strings",
        json.dumps({k: v for k, v in row.items() if k != "context"}): "missing field",
        json.dumps({**row, "dataset": "musique"}): "belongs to dataset 'musique'",
        json.dumps({**row, "length": "long"}): "non-negative integer",
    }
    for line, message in cases.items():
        (tmp_path / "hotpotqa.jsonl").write_text(good + "\n" + line + "\n")
        with pytest.raises(ValueError, match=message) as err:
            loader.load_records("hotpotqa", tmp_path)
        assert "hotpotqa.jsonl:2" in str(err.value)
    trec = json.loads((FIXTURES / "trec.jsonl").read_text().splitlines()[0])
    (tmp_path / "trec.jsonl").write_text(json.dumps({**trec, "all_classes": None}) + "\n")
    with pytest.raises(ValueError, match="all_classes"):
        loader.load_records("trec", tmp_path)


def test_missing_local_data_gives_both_ways_out(tmp_path: Path) -> None:
    with pytest.raises(loader.LongBenchUnavailable) as err:
        loader.load_records("qasper", tmp_path)
    text = str(err.value)
    assert "data.zip" in text and "--data-dir" in text and "pip install datasets" in text and "qasper.jsonl" in text
    with pytest.raises(loader.LongBenchUnavailable, match=r"lacks narrativeqa\.jsonl, qasper_e\.jsonl"):
        loader.check_local(tmp_path, ["narrativeqa", "qasper_e"])
    with pytest.raises(loader.LongBenchUnavailable, match="not a folder"):
        loader.check_local(tmp_path / "nowhere", ["qasper"])


def test_without_datasets_the_hub_path_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # simulate `datasets` not installed
    with pytest.raises(loader.LongBenchUnavailable) as err:
        loader.load_records("qasper")
    text = str(err.value)
    assert "`datasets` is not installed" in text and "data.zip" in text and "--data-dir" in text


def test_hub_rows_go_through_the_same_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    rows = [json.loads(line) for line in (FIXTURES / "passage_count_e.jsonl").read_text().splitlines()]

    def load_dataset(path: str, name: str, split: str, **kwargs: Any) -> list[dict[str, Any]]:
        calls.append((path, name, split, kwargs))
        return rows

    fake = types.ModuleType("datasets")
    fake.__version__ = "4.1.0"  # type: ignore[attr-defined]
    fake.load_dataset = load_dataset  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    hub = loader.load_records("passage_count", longbench_e=True, limit=2)
    assert calls == [("THUDM/LongBench", "passage_count_e", "test", {})]
    assert hub == loader.load_records("passage_count", FIXTURES, longbench_e=True, limit=2)

    def offline(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("cannot reach the hub")

    fake.load_dataset = offline  # type: ignore[attr-defined]
    with pytest.raises(loader.LongBenchUnavailable, match=r"cannot reach the hub.*data\.zip"):
        loader.load_records("qasper")


def _longbench_reference(tokenizer: Any, prompt: str, max_length: int) -> str:
    """LongBench's pred.py: keep the first and last int(max_length / 2) tokens, decoded separately."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_length:
        return prompt
    half = int(max_length / 2)
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )


@pytest.mark.parametrize("max_length", [2000, 701, 400, 150])
def test_truncation_matches_longbench_and_splits_at_the_context(tok: Any, max_length: int) -> None:
    record = loader.load_records("narrativeqa", FIXTURES)[0]
    head, tail = tasks.split_template("narrativeqa", record.input)
    prompt = tasks.PROMPTS["narrativeqa"].format(context=record.context, input=record.input)
    assert head + record.context + tail == prompt
    sample = make_sample(record, tok, max_length)
    assert sample.context + sample.question == _longbench_reference(tok, prompt, max_length)
    n = len(prompt)  # one token per character
    assert sample.meta["prompt_tokens_before"] == n
    assert sample.meta["truncated_tokens"] == (0 if n <= max_length else n - 2 * (max_length // 2))
    if max_length // 2 >= len(tail):  # the cut falls inside the context: the question part is the template's tail
        assert sample.question == tail and sample.context.startswith(head)
    else:  # a cut wider than the context's share reaches into the tail (LongBench does the same)
        assert sample.question != tail and tail.endswith(sample.question)


def test_truncation_keeps_untouched_parts_verbatim(tok: Any) -> None:
    cut = middle_truncate(tok, ["HEAD ", "x" * 100, " TAIL"], 20)
    assert cut.parts == ["HEAD ", "xxxxx" + "xxxxx", " TAIL"] and cut.tokens == 110 and cut.removed == 90
    assert middle_truncate(tok, ["a", "b"], 5).parts == ["a", "b"]
    with pytest.raises(ValueError, match="at least 2"):
        middle_truncate(tok, ["a"], 1)


def test_samples_carry_longbench_settings(tok: Any) -> None:
    trec = make_sample(loader.load_records("trec", FIXTURES)[0], tok, 3500)
    assert trec.metric == "classification_score" and trec.max_new_tokens == 64 and not trec.chat
    assert trec.verbatim and trec.answer_prefix == "" and trec.gold == " City"  # raw prompt ending in ':'
    assert trec.meta["first_line"] and trec.meta["all_classes"] and trec.meta["bucket"] == "0-4k"
    assert set(trec.meta) >= {"dataset", "language", "length", "_id", "all_classes", "max_length"}
    gov = make_sample(loader.load_records("gov_report", FIXTURES)[0], tok, 3500)
    assert (
        gov.chat
        and gov.max_new_tokens == 512
        and gov.question == "\n\nNow, write a one-page summary of the report.\n\nSummary:"
    )
    assert gov.gold == gov.answers[0] and not gov.meta["first_line"]
    lcc = make_sample(loader.load_records("lcc", FIXTURES)[0], tok, 3500)
    assert lcc.question == "Next line of code:\n" and lcc.gold == lcc.answers[0]
    short = make_sample(loader.load_records("gov_report", FIXTURES)[0], tok, 3500)
    assert len(short.gold or "") <= 512


def test_verbatim_prompts_join_without_separator_and_follow_the_chat_list(tok: Any) -> None:
    trec = make_sample(loader.load_records("trec", FIXTURES)[0], tok, 3500)
    hotpot = make_sample(loader.load_records("hotpotqa", FIXTURES)[0], tok, 3500)
    for sample in (trec, hotpot):  # no chat template: exactly the LongBench prompt
        ctx, qst = encode_sample(tok, sample, chat=True)
        assert tok.decode(ctx + qst) == sample.context + sample.question
    chat_tok = exact_char_tokenizer()
    chat_tok.chat_template = "{% for m in messages %}<U>{{ m['content'] }}</U>{% endfor %}<A>"
    ctx, qst = encode_sample(chat_tok, hotpot, chat=True)
    assert chat_tok.decode(ctx + qst) == "<U>" + hotpot.context + hotpot.question + "</U><A>"
    assert chat_tok.decode(ctx) == "<U>" + hotpot.context
    ctx, qst = encode_sample(chat_tok, trec, chat=True)  # trec is on LongBench's no-chat list
    assert chat_tok.decode(ctx + qst) == trec.context + trec.question
    ctx, qst = encode_sample(chat_tok, hotpot, chat=False)  # --no-chat
    assert chat_tok.decode(ctx + qst) == hotpot.context + hotpot.question


def test_buckets() -> None:
    assert [buckets.bucket_of(n) for n in (0, 3999, 4000, 7999, 8000, 30000)] == [
        "0-4k",
        "0-4k",
        "4-8k",
        "4-8k",
        "8k+",
        "8k+",
    ]


def _lb(tmp_path: Path, **kw: Any) -> SweepConfig:
    base: dict[str, Any] = dict(out=tmp_path / "run", benchmark="longbench", data_dir=str(FIXTURES), tasks=["en"])
    base.update(kw)
    return SweepConfig(**base)


def test_sweep_config_for_longbench(tmp_path: Path, no_jieba: Any) -> None:
    config = _lb(tmp_path)
    assert config.tasks == list(tasks.EN_DATASETS)
    assert config.max_new_tokens == 512  # each dataset then generates up to its own LongBench length
    identity = config.identity()
    assert identity["data_dir"] == str(FIXTURES.resolve()) and identity["longbench_e"] is False
    assert _lb(tmp_path, max_new_tokens=16).max_new_tokens == 16
    assert _lb(tmp_path, tasks=["hotpotqa"], longbench_e=True).identity()["longbench_e"] is True
    ruler = SweepConfig(out=tmp_path / "r", tasks=["vt"])
    assert "data_dir" not in ruler.identity() and "longbench_e" not in ruler.identity()  # old folders resume
    with pytest.raises(segment.MissingJieba, match="jieba"):
        _lb(tmp_path, tasks=["all"])  # multifieldqa_zh, dureader, vcsum need jieba
    assert _lb(tmp_path, tasks=["lsht", "passage_retrieval_zh"]).tasks == ["lsht", "passage_retrieval_zh"]
    with pytest.raises(ValueError, match="unknown LongBench task"):
        _lb(tmp_path, tasks=["niah_single_1"])
    with pytest.raises(ValueError, match="unknown LongBench-E task"):
        _lb(tmp_path, tasks=["narrativeqa"], longbench_e=True)
    with pytest.raises(loader.LongBenchUnavailable, match=r"lacks qasper_e\.jsonl"):
        _lb(tmp_path, tasks=["qasper"], longbench_e=True)
    with pytest.raises(ValueError, match="LongBench options"):
        SweepConfig(out=tmp_path / "r", tasks=["vt"], data_dir=str(FIXTURES))


def test_sweep_config_without_data_dir_or_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(loader.LongBenchUnavailable, match="--data-dir"):
        _lb(tmp_path, data_dir=None)
