"""The cache while a prompt is prefilled: the ``LayerState`` a layer's prefill gives the selection
(:mod:`.state_builder`), the full-cache capture ``from_states`` compresses (:mod:`.capture`), KVzip's
repeat pass (:mod:`.reconstruction_cache`) and the cross-layer prefill that holds only the entries that
can still win a joint selection (:mod:`.joint`)."""

from criticalkv.cache.prefill.capture import CaptureCache
from criticalkv.cache.prefill.joint import JointPrefill, bounded
from criticalkv.cache.prefill.reconstruction_cache import ReconstructionCache
from criticalkv.cache.prefill.state_builder import DEFAULT_WINDOW, check_window, state_from_prefill, synchronize

__all__ = [
    "DEFAULT_WINDOW",
    "CaptureCache",
    "JointPrefill",
    "ReconstructionCache",
    "bounded",
    "check_window",
    "state_from_prefill",
    "synchronize",
]
