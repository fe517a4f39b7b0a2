"""What the server is started with: the model's name, the default cache and the limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from criticalkv.cache import CacheSpec
from criticalkv.defaults import DEFAULT_METHOD
from criticalkv.options import OptionError
from criticalkv.serve.errors import invalid

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def default_spec() -> CacheSpec:
    """The server's default cache: the library's default method at budget 0.2, a 64-token window."""
    return CacheSpec.of(DEFAULT_METHOD, 0.2, 64)


@dataclass
class ServerConfig:
    """Settings of one server (``criticalkv serve``'s options).

    ``spec`` is the default cache every context and prompt is compressed with (its storage, e.g.
    quantized, is the server's: a request may change only the method, budget and window, see
    :meth:`spec_for`). ``methods`` lists the other methods a request may ask for; budgets are
    fractions of the context in ``[min_budget, 1]``. ``memory_cap_bytes`` caps the keys and
    values of the stored contexts held in memory (least recently used ones spill to ``store``
    and come back on demand); ``max_sessions`` caps the requests admitted at once (queued or
    decoding; one more waits up to ``admission_wait_s`` for a slot, then answers 429) and
    ``max_batch`` the answers decoded at once, as the rows of one batch (the others wait their
    turn in the queue). The memory cap also bounds the batch: an answer starts only if the
    stored context it reads (counted once however many rows read it) fits beside the rows' KV
    bytes (``Engine.rows_bytes``). A chat prompt of at least ``offload_prompt_tokens`` tokens is
    compressed on the compression thread beside the decode steps (:mod:`~criticalkv.serve.prompt_queue`),
    a shorter one on the decode worker; prompts queued together are compressed together (up to
    ``max_batch`` prompts and ``prefill_batch_tokens`` padded tokens in one prefill).
    """

    model_name: str = "default"
    spec: CacheSpec = field(default_factory=default_spec)
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
    api_key: str | None = field(default=None, repr=False)
    #: request bodies above this many bytes are refused (413) before they are read or parsed
    max_body_bytes: int = 16 * 2**20
    #: a request that finds every one of ``max_sessions`` slots taken waits this many seconds for
    #: one before its 429 (which carries ``Retry-After``): a client sending more requests at once
    #: than the server admits (lm-eval's ``num_concurrent``) is served in turn
    admission_wait_s: float = 30.0

    def allowed_methods(self) -> tuple[str, ...]:
        """The default method's name, then the others a request may ask for."""
        default = self.spec.method.name
        return (default, *[m for m in self.methods if m != default])

    def spec_for(self, method: str | None, budget: float | None, window: int | None) -> CacheSpec:
        """A request's spec: the default :attr:`spec` with the request's method, budget and window
        (``None``: the default's); a 400 naming the option when it is out of the server's limits."""
        if method is not None and method not in self.allowed_methods():
            raise invalid(
                f"method {method!r} is not served here; choose one of {', '.join(self.allowed_methods())}", "method"
            )
        value = self.spec.budget if budget is None else budget
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not self.min_budget <= value <= 1:
            raise invalid(
                f"budget must be a fraction of the context in [{self.min_budget}, 1], not {value!r}", "budget"
            )
        value = self.spec.window if window is None else window
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= self.max_window:
            raise invalid(
                f"window must be an integer number of tokens in [1, {self.max_window}], not {value!r}", "window"
            )
        fraction = None if budget is None else float(budget)  # 1 is the whole context, not one token
        try:
            return self.spec.replaced(method=method, budget=fraction, window=window)
        except OptionError as error:
            named = [name for name in error.options if name in ("method", "budget", "window")]
            raise invalid(str(error), named[0] if named else "budget") from None


def check_binding(host: str, api_key: str | None, force: bool) -> None:
    """Refuse to listen beyond this machine without an API key, unless forced."""
    if host not in LOCAL_HOSTS and not api_key and not force:
        raise ValueError(
            f"--host {host} accepts connections from other machines: set --api-key (or CRITICALKV_API_KEY) so "
            "every request must carry it, or pass --force to serve without one"
        )
