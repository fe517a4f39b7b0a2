"""The library's defaults and choices that the command line shows, in a module that imports nothing.

``criticalkv --help`` and every subcommand's ``--help`` read their defaults from here, so printing
help never imports torch or transformers; the modules that own each value (named beside it) import
it from here and re-export it under its usual name.
"""

from __future__ import annotations

#: the method ``generate``, ``serve``, :func:`criticalkv.generate`, ``CompressedCache`` and the lm-eval
#: model use when none is named: the guide's choice for general use (docs/methods.md, "Which method to
#: pick"): on the 20-sample RULER sweep at budget 0.2 it scores 48.7 where the full cache scores 61.2
#: and critical-adakv, the earlier default, 3.3 (docs/results/ruler-default.md)
DEFAULT_METHOD = "layer-defensivekv"
#: the prompt modes (:mod:`criticalkv.runtime.generate`)
MODES: tuple[str, ...] = ("question-aware", "question-agnostic")
#: default observation windows: the AdaKV repo (question-aware) and kvpress (question-agnostic)
DEFAULT_WINDOWS: dict[str, int] = {"question-aware": 32, "question-agnostic": 64}
#: decode-time compression re-selects after this many new entries per head (:mod:`criticalkv.cache.decode`)
DEFAULT_INTERVAL = 64
#: entries (keys: tokens, values: channels) sharing one scale and zero point, per bit width, chosen
#: by measurement (docs/results/quantized-storage.md): 8 bits at 64 moved the NLL by 0.011 nats/token
#: at budget 0.5 (target < 0.01), at 32 by 0.0013; 4 bits at 32 cost over 5 bits per element, at 64
#: (one value group per token at head dimension 64) 4.5 per whole block (:mod:`criticalkv.cache.quantized`)
DEFAULT_GROUP_SIZES: dict[int, int] = {8: 32, 4: 64}
#: ``kv_bits`` values that mean "not quantized": the model's own dtype (a spec's ``storage`` is ``None``)
UNQUANTIZED_BITS: tuple[int, ...] = (16, 32)
#: most recent appended tokens kept in full precision (capped at the smallest per-head budget)
DEFAULT_RESIDUAL = 64
#: the options that hold a cache while it decodes (:class:`~criticalkv.cache.DecodeBudget`)
DECODE_OPTIONS: tuple[str, ...] = ("decode_budget", "decode_interval")
#: the options of its storage (:class:`~criticalkv.cache.quantized.KVQuantization`), as records name them
STORAGE_OPTIONS: tuple[str, ...] = ("kv_bits", "kv_group_size", "kv_residual")
#: the keyword arguments :meth:`~criticalkv.cache.CacheSpec.of` takes, as the library's messages name them
SPEC_OPTIONS: tuple[str, ...] = ("method", "budget", "window", *DECODE_OPTIONS, *STORAGE_OPTIONS)
#: dtypes of the Critical selections' value norms (:mod:`criticalkv.scores.value_norms`)
NORM_PRECISIONS: tuple[str, ...] = ("auto", "exact", "float32", "bfloat16", "float16")
