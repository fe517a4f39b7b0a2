"""Decode-time compression: a cache held at a decode budget while it generates
(:mod:`.budget`), each layer re-selected by the method's own code (:mod:`.reselect`); methods
whose budgets span layers hold each layer to its share, frozen from the prompt (:mod:`.shares`)."""

from criticalkv.cache.decode.budget import DEFAULT_INTERVAL, DecodeCompression, check_decode_budget

__all__ = ["DEFAULT_INTERVAL", "DecodeCompression", "check_decode_budget"]
