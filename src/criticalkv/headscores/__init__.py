"""Head importance scores for HeadKV's head-prior budgets (Fu et al. 2024, arXiv 2410.19258).

* :mod:`~criticalkv.headscores.needles` builds the needle-retrieval samples (in haystacks of
  :mod:`~criticalkv.headscores.haystack`, which the eval tasks and the bench prompts share) that
  :mod:`criticalkv.analysis.retrieval_heads` runs the model on (``criticalkv head-scores``): the
  model-running half sits above the runtime, this package below it (methods bind its files).
* :mod:`~criticalkv.headscores.file` reads, checks and writes score files with provenance.
* :mod:`~criticalkv.headscores.lookup` finds a model's scores; :func:`criticalkv.methods.bind`
  binds them to a method.
"""

from criticalkv.headscores.file import HeadScores, architecture, fingerprint, load_head_scores
from criticalkv.headscores.lookup import cache_path, find_head_scores, model_name
from criticalkv.headscores.needles import RetrievalSample, make_retrieval_sample

__all__ = [
    "HeadScores",
    "RetrievalSample",
    "architecture",
    "cache_path",
    "find_head_scores",
    "fingerprint",
    "load_head_scores",
    "make_retrieval_sample",
    "model_name",
]
