"""lm-eval's own RULER ``niah_single_1`` (synthetic, 1024 tokens, the local tokenizer) on the default
model: ``criticalkv`` with ``method=full`` answers and scores as lm-eval's ``hf`` model on the
default model's converted folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from criticalkv.models import default_model_dir, load_tokenizer
from tests.helpers.lmeval_tasks import evaluate, responses

pytestmark = pytest.mark.slow  # the default model, two runs of two 1K-token samples: minutes here


def test_niah_single_1_with_method_full_equals_lm_evals_hf_model(tmp_path: Path) -> None:
    load_tokenizer("default")  # converts the default model once if needed
    folder = default_model_dir()
    metadata = {"max_seq_lengths": [1024], "tokenizer": str(folder)}
    options = {"metadata": metadata, "limit": 2, "gen_kwargs": "max_gen_toks=16"}
    hf = evaluate("hf", f"pretrained={folder},dtype=float32", ["niah_single_1"], tmp_path, **options)
    ours = evaluate("criticalkv", "pretrained=default,method=full", ["niah_single_1"], tmp_path, **options)
    assert responses(ours, "niah_single_1") == responses(hf, "niah_single_1")
    assert ours["results"]["niah_single_1"]["1024,none"] == hf["results"]["niah_single_1"]["1024,none"]
    assert json.dumps(ours["config"]["criticalkv"]["kv_ratio_mean"]) == "1.0"
