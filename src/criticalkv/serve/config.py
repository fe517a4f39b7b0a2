"""What the server is started with: the model's name, the default compression and the limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from criticalkv.cache.quantized import KVQuantization, quantization_for
from criticalkv.defaults import DEFAULT_METHOD
from criticalkv.serve.errors import invalid

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass
class ServerConfig:
    """Settings of one server (``criticalkv serve``'s options).

    ``methods`` lists the methods a request may ask for (the default ``method`` is always
    allowed); budgets are fractions of the context in ``[min_budget, 1]``. ``memory_cap_bytes``
    caps the keys and values of the stored contexts held in memory (least recently used ones
    spill to ``store`` and come back on demand); ``max_sessions`` caps the requests admitted at
    once (queued or decoding; one more waits up to ``admission_wait_s`` for a slot, then answers
    429) and ``max_batch`` the answers decoded at once, as the rows of one batch (the others
    wait their turn in the queue). The memory cap also bounds the batch: an answer starts only
    if the stored context it reads (counted once however many rows read it) fits beside the
    rows' KV bytes (``Engine.rows_bytes``). A chat prompt of at least ``offload_prompt_tokens``
    tokens is compressed on the compression thread beside the decode steps
    (:mod:`~criticalkv.serve.prompts`), a shorter one on the decode worker; prompts queued
    together are compressed together (up to ``max_batch`` prompts and ``prefill_batch_tokens``
    padded tokens in one prefill).
    """

    model_name: str = "default"
    method: str = DEFAULT_METHOD
    budget: float = 0.2
    window: int = 64
    methods: tuple[str, ...] = ()
    min_budget: float = 0.01
    max_window: int = 512
    max_new_tokens: int = 256
    memory_cap_bytes: int = 2 * 2**30
    max_sessions: int = 16
    max_batch: int = 8
    offload_prompt_tokens: int = 128
    #: prompts queued together are compressed in one prefill of at most this many padded tokens
    prefill_batch_tokens: int = 4096
    #: an idle compression thread waits this long for prompts sent at the same moment (to batch them)
    prefill_gather_s: float = 0.05
    store: Path | None = None
    kv_bits: int = 16
    kv_group_size: int | None = None  # None: the bit width's default (quant_spec.DEFAULT_GROUP_SIZES)
    kv_residual: int | None = None
    api_key: str | None = field(default=None, repr=False)
    #: request bodies above this many bytes are refused (413) before they are read or parsed
    max_body_bytes: int = 16 * 2**20
    #: a request that finds every one of ``max_sessions`` slots taken waits this many seconds for
    #: one before its 429 (which carries ``Retry-After``): a client sending more requests at once
    #: than the server admits (lm-eval's ``num_concurrent``) is served in turn
    admission_wait_s: float = 30.0

    def allowed_methods(self) -> tuple[str, ...]:
        return (self.method, *[m for m in self.methods if m != self.method])

    def quantization(self, model_config: object = None) -> KVQuantization | None:
        """The storage precision (``None``: the model's dtype); a ``ValueError`` saying what to
        change if the options are invalid (for ``model_config``'s head dimension, when given)."""
        return quantization_for(self.kv_bits, self.kv_group_size, self.kv_residual, config=model_config)

    def compression(self, method: str | None, budget: float | None, window: int | None) -> tuple[str, float, int]:
        """A request's (method, budget, window), defaults filled in; a 400 when out of the limits."""
        method = self.method if method is None else method
        if method not in self.allowed_methods():
            raise invalid(
                f"method {method!r} is not served here; choose one of {', '.join(self.allowed_methods())}", "method"
            )
        budget = self.budget if budget is None else budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not self.min_budget <= budget <= 1:
            raise invalid(
                f"budget must be a fraction of the context in [{self.min_budget}, 1], not {budget!r}", "budget"
            )
        window = self.window if window is None else window
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= self.max_window:
            raise invalid(
                f"window must be an integer number of tokens in [1, {self.max_window}], not {window!r}", "window"
            )
        return method, float(budget), window


def check_binding(host: str, api_key: str | None, force: bool) -> None:
    """Refuse to listen beyond this machine without an API key, unless forced."""
    if host not in LOCAL_HOSTS and not api_key and not force:
        raise ValueError(
            f"--host {host} accepts connections from other machines: set --api-key (or CRITICALKV_API_KEY) so "
            "every request must carry it, or pass --force to serve without one"
        )
