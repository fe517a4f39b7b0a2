"""lm-evaluation-harness support: the ``criticalkv`` model (``lm-eval`` is the ``[lm-eval]`` extra).

Importing this package registers the model with lm-eval (``@register_model("criticalkv")``), after
which ``lm_eval.simple_evaluate(model="criticalkv", ...)`` finds it; ``criticalkv lm-eval ...``
registers it and runs lm-eval's command line (docs/lm-eval.md).
"""

from __future__ import annotations

try:
    import lm_eval  # noqa: F401
except ImportError as error:  # pragma: no cover - only without the extra
    raise ImportError(
        "criticalkv's lm-eval model needs lm-eval: pip install 'criticalkv[lm-eval]' "
        "(lm-eval 0.4.13 with RULER's packages)"
    ) from error

from criticalkv.eval.lmeval.model import CriticalKVLM
from criticalkv.eval.lmeval.model_args import MODEL_ARGS, LMEvalOptions

__all__ = ["MODEL_ARGS", "CriticalKVLM", "LMEvalOptions"]
