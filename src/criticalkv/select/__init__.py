"""Selection: which entries each head keeps, given its budget."""

from criticalkv.select.adaptive_critical import AdaptiveCritical
from criticalkv.select.base import RankingSelector, Selector
from criticalkv.select.critical import Critical
from criticalkv.select.topk import TopK, topk_mask

__all__ = ["AdaptiveCritical", "Critical", "RankingSelector", "Selector", "TopK", "topk_mask"]
