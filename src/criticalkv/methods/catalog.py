"""The methods criticalkv registers: named (scores, budgets, selection) triples.

A method is the paper's Algorithm 2 template (accumulate scores -> allocate budgets ->
select per head) with one choice for each step. CriticalKV is a selection step, so
``critical-adakv`` is AdaKV's scores and budgets with the two-stage critical selection.
"""

from __future__ import annotations

from criticalkv.budgets.adaptive import Adaptive
from criticalkv.budgets.head_prior import HeadPrior
from criticalkv.budgets.layer_joint import LayerJoint
from criticalkv.budgets.pyramid import Pyramid
from criticalkv.methods.method import Method
from criticalkv.methods.registry import register
from criticalkv.scores.accumulated_attention import AccumulatedAttention
from criticalkv.scores.defensive_aggregation import DefensiveAggregation
from criticalkv.scores.expected_attention import ExpectedAttention
from criticalkv.scores.key_diff import KeyDissimilarity
from criticalkv.scores.key_norm import KeyNorm
from criticalkv.scores.kvzip import ReconstructionAttention
from criticalkv.scores.last_query import LastQueryAttention
from criticalkv.scores.positional import SinksAndRecent
from criticalkv.scores.window_attention import WindowAttention
from criticalkv.select.adaptive_critical import AdaptiveCritical
from criticalkv.select.critical import Critical

_SNAPKV = "Li et al. 2024, SnapKV (arXiv 2404.14469)"
_ADAKV = "Feng et al. 2024, Ada-KV (arXiv 2407.11550)"
_CRITICAL = "Feng et al. 2025, CriticalKV (arXiv 2502.03805)"
_PYRAMIDKV = "Cai et al. 2024, PyramidKV (arXiv 2406.02069)"
_HEADKV = "Fu et al. 2024, HeadKV: Not All Heads Matter (arXiv 2410.19258)"
_STREAMINGLLM = "Xiao et al. 2023, StreamingLLM (arXiv 2309.17453)"
_H2O = "Zhang et al. 2023, H2O (arXiv 2306.14048)"
_KNORM = "Devoto et al. 2024, Knorm (arXiv 2406.11430)"
_TOVA = "Oren et al. 2024, TOVA: Transformers are Multi-State RNNs (arXiv 2401.06104)"
_KEYDIFF = "Park et al. 2025, KeyDiff (arXiv 2504.15364)"
_EXPECTED = "Devoto et al. 2025, Expected Attention (arXiv 2510.00636; kvpress)"
_KVZIP = "Kim et al. 2025, KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction (arXiv 2505.23416)"
_DEFENSIVEKV = "Feng et al. 2025, DefensiveKV: Taming the Fragility of KV Cache Eviction (arXiv 2510.13334)"

# each method's colour in every figure (demo, eval, report, bench, perturbation): a base method and its
# Critical variant share a hue family (light / dark), the full cache is black
register(Method("full", "No compression: every entry is kept (the reference).", "-", None), colour="#000000")
register(
    Method("snapkv", "Window attention, uniform budgets, top-k per head.", _SNAPKV, WindowAttention()), colour="#6baed6"
)
register(
    Method(
        "adakv",
        "Window attention, adaptive cross-head budgets (safeguard 0.2), top-k per head.",
        _ADAKV,
        WindowAttention(),
        budgets=Adaptive(),
    ),
    colour="#fd8d3c",
)
register(
    Method(
        "critical-snapkv",
        "SnapKV scores and budgets; two-stage selection by attention x ||V W_O||_1.",
        _CRITICAL,
        WindowAttention(),
        select=Critical(),
    ),
    colour="#08519c",
)
register(
    Method(
        "critical-adakv",
        "AdaKV scores and budgets; two-stage selection by attention x ||V W_O||_1.",
        _CRITICAL,
        WindowAttention(),
        budgets=Adaptive(),
        select=Critical(),
    ),
    colour="#a63603",
)
register(
    Method(
        "pyramidkv",
        "Window attention, layer budgets decreasing linearly with depth (beta 20), top-k per head.",
        _PYRAMIDKV,
        WindowAttention(),
        budgets=Pyramid(),
    ),
    colour="#9e9ac8",
)
register(
    Method(
        "critical-pyramidkv",
        "PyramidKV scores and budgets; two-stage selection by attention x ||V W_O||_1.",
        _CRITICAL,
        WindowAttention(),
        budgets=Pyramid(),
        select=Critical(),
    ),
    colour="#54278f",
)
register(
    Method(
        "headkv",
        "Window attention, per-head budgets from retrieval-reasoning head scores (beta 1.5), top-k per head.",
        _HEADKV,
        WindowAttention(),
        budgets=HeadPrior(),
    ),
    colour="#f768a1",
)
register(
    Method(
        "critical-headkv",
        "HeadKV scores and budgets; two-stage selection by attention x ||V W_O||_1.",
        _CRITICAL,
        WindowAttention(),
        budgets=HeadPrior(),
        select=Critical(),
    ),
    colour="#ae017e",
)
register(
    Method(
        "streamingllm",
        "Attention sinks (the first 4 tokens) plus the most recent tokens, uniform budgets.",
        _STREAMINGLLM,
        SinksAndRecent(),
    ),
    colour="#969696",
)
register(
    Method(
        "h2o",
        "Attention accumulated over all prompt queries (heavy hitters) plus the window, uniform budgets.",
        _H2O,
        AccumulatedAttention(),
    ),
    colour="#bcbd22",
)
register(
    Method(
        "knorm",
        "Keeps the keys with the lowest L2 norm (score -||k||), uniform budgets.",
        _KNORM,
        KeyNorm(),
    ),
    colour="#8c564b",
)
register(
    Method(
        "defensivekv",
        "Defensive aggregation (window max, floored at the head mean); adaptive stage 1 (90% of the attention "
        "mass), then attention x head-normalised ||V W_O||_1; budgets pooled over the layer's heads.",
        _DEFENSIVEKV,
        DefensiveAggregation(),
        budgets=Adaptive(alpha_floor=0.0),
        select=AdaptiveCritical(),
    ),
    colour="#74c476",
)
register(
    Method(
        "layer-defensivekv",
        "DefensiveKV with one selection over all layers and heads (same total budget; per-layer totals vary).",
        _DEFENSIVEKV,
        DefensiveAggregation(),
        budgets=LayerJoint(),
        select=AdaptiveCritical(),
    ),
    colour="#006d2c",
)
register(
    Method(
        "tova",
        "The last query's attention, averaged over all heads of the layer (one ranking per layer), top-k.",
        _TOVA,
        LastQueryAttention(),
    ),
    colour="#17becf",
)
register(
    Method(
        "critical-tova",
        "TOVA scores and budgets; two-stage selection by attention x ||V W_O||_1.",
        f"{_CRITICAL}; {_TOVA}",
        LastQueryAttention(),
        select=Critical(),
    ),
    colour="#0b6b75",
)
register(
    Method(
        "keydiff",
        "Keeps the keys least similar in direction to the mean key (score -cos(k, mean unit key)), top-k.",
        _KEYDIFF,
        KeyDissimilarity(),
    ),
    colour="#e377c2",
)
register(
    Method(
        "expected-attention",
        "Expected attention of future queries (prompt query mean and covariance, RoPE of the next 512 "
        "positions) times ||V||_2, question-agnostic, top-k.",
        _EXPECTED,
        ExpectedAttention(),
    ),
    colour="#c7a26b",
)
register(
    Method(
        "critical-expected-attention",
        "Expected attention (without kvpress's ||V||_2 rescaling); two-stage selection by attention x ||V W_O||_1.",
        f"{_CRITICAL}; {_EXPECTED}",
        ExpectedAttention(value_norm=False),
        select=Critical(),
    ),
    colour="#7f5a1e",
)
register(
    Method(
        "kvzip",
        "Most attention received while the model repeats the context (one extra pass), question-agnostic; "
        "one top-k over all layers and heads (the paper's and kvpress's non-uniform budgets).",
        _KVZIP,
        ReconstructionAttention(),
        budgets=LayerJoint(),
    ),
    colour="#ff9896",
)
register(
    Method(
        "critical-kvzip",
        "KVzip scores and budgets; two-stage selection by attention x ||V W_O||_1.",
        f"{_CRITICAL}; {_KVZIP}",
        ReconstructionAttention(),
        budgets=LayerJoint(),
        select=Critical(),
    ),
    colour="#d62728",
)
