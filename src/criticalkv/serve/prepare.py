"""The checks every request gets before any work, written once for every route: the model and
``n``, sampling, stop sequences, and one preparation of a prompt's (or a document's) compression
(:func:`compression_for`): the context length, the request's options, whether it can be compressed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from criticalkv.cache import CacheSpec, PromptTooShort
from criticalkv.serve.compress import check_compressible
from criticalkv.serve.errors import APIError, invalid
from criticalkv.serve.sampling import Sampling
from criticalkv.serve.schemas import Compression

#: the most stop sequences a request may set (OpenAI allows 4; lm-eval sends a task's `until` strings and
#: its end-of-sequence text, 7 for a task with 6)
MAX_STOPS = 16


def check_model_and_n(model: str, n: int | None, served: str) -> None:
    """A 404 unless ``model`` is the one served, a 400 unless ``n`` is 1 (or absent)."""
    if model != served:
        raise APIError(
            404,
            f"model {model!r} is not served here; use {served!r}",
            param="model",
            code="model_not_found",
            type="not_found_error",
        )
    if n not in (None, 1):
        raise invalid("only n=1 is supported", "n")


def sampling_of(body: Any) -> Sampling:
    """The request's ``temperature`` (in [0, 2]; left out: 0, greedy, as the server always
    answered, unlike OpenAI's default of 1), ``top_p`` (in (0, 1]) and ``seed``."""
    temperature = 0.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0 <= temperature <= 2:
        raise invalid(f"temperature must be in [0, 2], not {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], not {top_p}", "top_p")
    return Sampling(temperature, top_p, body.seed)


def stops_of(stop: object) -> tuple[str, ...]:
    """The request's ``stop``: a string or a list of up to :data:`MAX_STOPS` non-empty strings."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise invalid(f"stop takes at most {MAX_STOPS} sequences, not {len(stops)}", "stop")
    if any(not s for s in stops):
        raise invalid("stop sequences must be non-empty strings", "stop")
    return tuple(stops)


def too_long(limit: int, need: int, what: str, advice: str, param: str) -> APIError:
    """A 400 ``context_length_exceeded``: ``what`` needs ``need`` tokens of the model's ``limit``."""
    return invalid(f"this model accepts {limit} tokens; {what} need {need}; {advice}", param, "context_length_exceeded")


def compression_for(
    engine: Any, tokens: int, request: Compression, param: str, what: str = "prompt", overflow: APIError | None = None
) -> CacheSpec:
    """The spec a prompt of ``tokens`` tokens is compressed with: the request's options over the
    server's (:meth:`~criticalkv.serve.config.ServerConfig.spec_for`), checked; a prompt within the
    window is kept whole (at budget 1), and one too short to compress at the server's own defaults
    (a greeting, a short question) is kept whole too, which costs at most window / budget tokens;
    a budget or window the request set itself is refused instead, with the reason (a 400 naming
    the option, or ``param`` when neither was set). A ``what`` of ``"document"`` (a context to
    store) is never kept whole: it must hold the window and be compressible as asked.
    ``overflow`` (the prompt does not fit the model's context) is raised once the options are checked."""
    spec = engine.config.spec_for(request.method, request.budget, request.window)
    at_fault = "window" if request.window is not None else "budget" if request.budget is not None else param
    if what == "document" and tokens < spec.window:
        raise invalid(
            f"the document has {tokens} tokens, fewer than the observation window ({spec.window}); "
            "send a longer document or a smaller window",
            param,
        )
    if overflow is not None:
        raise overflow
    if what != "document":
        spec = spec.replaced(window=min(spec.window, tokens))
        if at_fault == param:
            try:
                spec.check_compressible(tokens, what)
            except PromptTooShort:
                spec = spec.replaced(budget=1.0)
    check_compressible(spec, tokens, what, at_fault)
    return spec


#: how often a request waiting for a slot looks again (seconds)
_ADMISSION_POLL_S = 0.02


async def admit(engine: Any) -> None:
    """Take one of the engine's ``max_sessions`` slots, waiting up to the server's
    ``admission_wait_s`` for one to free (requests are admitted on the event loop, so nothing
    takes the slot between the look and the admission); then a 429 with ``Retry-After``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + engine.config.admission_wait_s
    while engine.admitted() >= engine.config.max_sessions and loop.time() < deadline:
        await asyncio.sleep(_ADMISSION_POLL_S)
    engine.admit()
