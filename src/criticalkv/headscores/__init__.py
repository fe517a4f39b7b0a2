"""Head importance scores for HeadKV's head-prior budgets (Fu et al. 2024, arXiv 2410.19258).

* :mod:`~criticalkv.headscores.compute` runs the scoring procedure on needle-retrieval samples
  (:mod:`~criticalkv.headscores.needles`, in haystacks of :mod:`~criticalkv.headscores.haystack`,
  which the eval tasks and the bench prompts share); ``criticalkv head-scores`` is its command.
* :mod:`~criticalkv.headscores.file` reads, checks and writes score files with provenance.
* :mod:`~criticalkv.headscores.binding` finds a model's scores; :func:`criticalkv.methods.bind`
  binds them to a method.
"""

from criticalkv.headscores.binding import cache_path, find_head_scores
from criticalkv.headscores.file import HeadScores, architecture, fingerprint, load_head_scores

__all__ = [
    "HeadScores",
    "architecture",
    "cache_path",
    "find_head_scores",
    "fingerprint",
    "load_head_scores",
]
