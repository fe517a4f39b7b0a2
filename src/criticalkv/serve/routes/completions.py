"""``POST /v1/completions``: OpenAI's legacy completions, as lm-eval's ``local-completions`` uses them.

The prompt (text, token ids, or a list of either: one choice each) is compressed question-aware
with the request's (or the server's) method, budget and window, and decoded by the engine's
batched worker like a chat answer without a chat template (:class:`CompletionSession`, which also
notes each generated token's log-probability). ``echo`` puts the prompt before the answer; with
``logprobs`` it also scores every prompt token, from one uncompressed prefill of the prompt on the
compression thread: the server cannot tell which part of a prompt is the context, so prompt
scores are the full cache's (what ``loglikelihood`` through ``local-completions`` measures).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import torch
from fastapi import FastAPI, Request
from pydantic import BaseModel

from criticalkv.runtime import capture_prefill, input_device
from criticalkv.serve.engine import Engine
from criticalkv.serve.errors import invalid, server_error
from criticalkv.serve.hangup import outcome_or_hang_up
from criticalkv.serve.middleware import note_access
from criticalkv.serve.prepare import admit, check_model_and_n, compression_for, sampling_of, stops_of, too_long
from criticalkv.serve.schemas import CompletionRequest
from criticalkv.serve.session import Channel, ChatWork, Session
from criticalkv.serve.token_text import LOOKBACK, Pieces, token_pieces

#: the most alternatives per token a request may ask for (as OpenAI's API)
MAX_LOGPROBS = 5


class TokenScore(BaseModel):
    """One token's log-probability and its most likely alternatives."""

    token: int
    logprob: float
    top: dict[int, float]


def score_of(logits: torch.Tensor, token: int) -> TokenScore:
    """``token``'s float32 log-probability under the (V,) ``logits`` and the :data:`MAX_LOGPROBS` likeliest."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(MAX_LOGPROBS)
    return TokenScore(
        token=token, logprob=float(logprobs[token]), top=dict(zip(ids.tolist(), values.tolist(), strict=True))
    )


class CompletionChannel(Channel):
    """A request's channel that keeps the session answering it (for its token scores)."""

    session: CompletionSession | None = None

    def put(self, kind: str, value: Any) -> None:
        if kind == "done" and self.session is not None:
            self.session.note_pending()  # the last token's score, before the request reads them
        super().put(kind, value)


class CompletionSession(Session):
    """A chat session that also notes each generated token's :class:`TokenScore`."""

    def __init__(self, engine: Any, work: ChatWork, channel: Channel) -> None:
        super().__init__(engine, work, channel)
        self.scores: list[TokenScore] = []
        self.deciding: tuple[torch.Tensor, int] | None = None  # the logits being decided, tokens before
        if isinstance(channel, CompletionChannel):
            channel.session = self

    def first(self, logits: torch.Tensor) -> None:
        self.deciding = (logits, len(self.tokens))
        super().first(logits)
        self.note_pending()

    def advance(self, logits: torch.Tensor) -> None:
        self.deciding = (logits, len(self.tokens))
        super().advance(logits)
        self.note_pending()

    def note_pending(self) -> None:
        """Score the token the pending logits chose, if one was kept (an end-of-sequence token is not)."""
        if self.deciding is not None:
            logits, count = self.deciding
            self.deciding = None
            if len(self.tokens) > count:
                self.scores.append(score_of(logits, self.tokens[-1]))


def _prompts(body: CompletionRequest, engine: Engine) -> list[tuple[list[int], str | None]]:
    """The request's prompts as token ids (with the text, when sent as text), each checked
    (non-empty, ids in the vocabulary)."""
    prompt = body.prompt
    items: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    if not items:
        raise invalid("prompt is empty; send text or token ids", "prompt")
    vocabulary = int(engine.model.config.vocab_size)
    prompts = []
    for item in items:
        if isinstance(item, str):
            with engine.tokenizer_lock:
                ids = list(engine.tokenizer(item, add_special_tokens=False)["input_ids"])
        else:
            ids = list(item)
        if not ids:
            raise invalid("a prompt is empty; send text or token ids", "prompt")
        if any(not 0 <= t < vocabulary for t in ids):
            raise invalid(f"prompt token ids must be in [0, {vocabulary})", "prompt")
        prompts.append((ids, item if isinstance(item, str) else None))
    return prompts


def _check(body: CompletionRequest, engine: Engine) -> int:
    """The request's ``max_tokens`` after every check of its fields (a 400 or 404 naming the field)."""
    check_model_and_n(body.model, body.n, engine.config.model_name)
    if body.stream:
        raise invalid("streaming completions is not supported; send stream=false (chat completions stream)", "stream")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be in [0, {MAX_LOGPROBS}], not {body.logprobs}", "logprobs")
    most = engine.config.max_new_tokens
    max_tokens = min(16, most) if body.max_tokens is None else body.max_tokens
    if not (0 if body.echo else 1) <= max_tokens <= most:
        low = "0 (with echo)" if body.echo else "1"
        raise invalid(f"max_tokens must be in [{low}, {most}], not {max_tokens}", "max_tokens")
    return max_tokens


def _work(body: CompletionRequest, engine: Engine, ids: list[int], max_tokens: int) -> ChatWork | None:
    """The prompt's generation (``None`` for ``max_tokens`` 0: the echo alone), compressed as a
    chat prompt is (a short prompt kept whole at the server's defaults; a budget or window the
    request set itself refused when it cannot hold); a prompt that does not fit the model's
    context is a 400 on every path, an echo alone included."""
    need, limit = len(ids) + max_tokens, engine.max_positions
    advice = "send a shorter prompt or fewer max_tokens"
    if max_tokens == 0:
        if need > limit:
            raise too_long(limit, need, "the prompt and max_tokens", advice, "prompt")
        return None
    overflow = too_long(limit, need, "the prompt and max_tokens", advice, "prompt") if need > limit else None
    spec = compression_for(engine, len(ids), body, "prompt", overflow=overflow)
    admitted = time.perf_counter()
    return ChatWork(
        ids, None, spec, max_tokens, len(ids), admitted, sampling_of(body), stops_of(body.stop),
        ignore_eos=body.ignore_eos,
    )  # fmt: skip


async def _generate(work: ChatWork, engine: Engine, request: Request) -> tuple[dict[str, Any], list[TokenScore]]:
    """Run ``work`` on the engine's worker: its summary (text, finish reason) and token scores
    (a client that hangs up stops it: :class:`~criticalkv.serve.hangup.ClientGone`)."""
    await admit(engine)
    channel = CompletionChannel(asyncio.get_running_loop())
    engine.submit_chat(work, channel, CompletionSession)
    kind, value = await outcome_or_hang_up(channel, request)
    if kind == "error":
        raise value
    session = channel.session
    return dict(value), [] if session is None else session.scores


def prompt_scores(model: Any, ids: list[int]) -> list[TokenScore]:
    """The scores of ``ids[1:]``, each given the tokens before it, from one uncompressed prefill."""
    tensor = torch.tensor([ids], dtype=torch.long, device=input_device(model))
    with torch.no_grad():
        _, logits = capture_prefill(model, tensor, torch.ones_like(tensor), window=1, logits_to_keep=len(ids))
    return [score_of(logits[0, i - 1], ids[i]) for i in range(1, len(ids))]


async def _echo_scores(engine: Engine, ids: list[int]) -> list[TokenScore]:
    """:func:`prompt_scores` on the compression thread (beside the decode steps, after queued
    prefills), admitted and counted as every request's work is."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[list[TokenScore]] = loop.create_future()

    def job() -> None:
        try:
            result = prompt_scores(engine.model, ids)
        except Exception as error:  # answered on the request
            loop.call_soon_threadsafe(done.set_exception, server_error(error))
        else:
            loop.call_soon_threadsafe(done.set_result, result)
        finally:
            engine.release()

    await admit(engine)
    engine.compressor.submit(job)
    return await done


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first of ``stops`` starts in ``text`` (``None`` if none occurs)."""
    return min((at for stop in stops if (at := text.find(stop)) >= 0), default=None)


def _named_tops(scores: list[TokenScore | None], shown: list[int], pieces: Pieces, top: int) -> list[Any]:
    """Each position's ``top`` likeliest tokens by their piece of the text had they been chosen
    there (the chosen one by its own piece; a name two tokens share keeps the likelier's value)."""
    out: list[dict[str, float] | None] = []
    for i, score in enumerate(scores):
        if score is None:
            out.append(None)
            continue
        named: dict[str, float] = {}
        for t, value in list(score.top.items())[:top]:
            named.setdefault(pieces.pieces[i] if t == shown[i] else pieces.names[i].get(t, ""), value)
        out.append(named)
    return out


def _choice_body(
    engine: Engine, body: CompletionRequest, ids: list[int], scores: list[TokenScore | None], generated: list[int]
) -> tuple[str, dict[str, Any] | None]:
    """The choice's ``text`` and OpenAI's ``logprobs`` object (each token's piece of the text,
    log-probability, alternatives and offset in the text), both from one decode of the prompt's
    and the completion's tokens (:func:`token_pieces`), so that they describe the same tokens;
    the completion ends before its first stop sequence, its tokens with the one the stop starts in."""
    shown = [*ids, *generated] if body.echo else generated
    context = [] if body.echo else ids[-2 * LOOKBACK :]  # what the first generated token follows
    tops: list[list[int]] = [[] for _ in context] + [[] if s is None else list(s.top) for s in scores]
    with engine.tokenizer_lock:
        decoded = token_pieces(engine.tokenizer, [*context, *shown], tops)
    pieces = Pieces(decoded.pieces[len(context) :], decoded.names[len(context) :])
    text, offsets = pieces.text, pieces.offsets()
    prompt_chars = offsets[len(ids)] if body.echo and len(shown) > len(ids) else len(text) if body.echo else 0
    stop = _first_stop(text[prompt_chars:], stops_of(body.stop))
    kept, shown_pieces = len(shown), list(pieces.pieces)
    if stop is not None:  # the tokens up to the one the stop starts in, that one's piece cut where text ends
        text = text[: prompt_chars + stop]
        kept = sum(1 for at in offsets if at < len(text))
        if kept:
            shown_pieces[kept - 1] = shown_pieces[kept - 1][: len(text) - offsets[kept - 1]]
    if body.logprobs is None:
        return text, None
    top = max(body.logprobs, 1) if body.logprobs else 0
    logprobs = {
        "tokens": shown_pieces[:kept],
        "token_logprobs": [None if s is None else s.logprob for s in scores[:kept]],
        "top_logprobs": _named_tops(scores[:kept], shown, pieces, top),
        "text_offset": offsets[:kept],
    }
    return text, logprobs


async def _choice(
    body: CompletionRequest,
    engine: Engine,
    request: Request,
    prompt: tuple[list[int], ChatWork | None],
    index: int,
    summaries: dict[str, Any],
) -> Any:
    """One prompt's choice and its (prompt, completion) token counts (its time to first token
    and KV bytes noted in ``summaries``, for the access log)."""
    ids, work = prompt
    summary: dict[str, Any] = {"text": "", "finish_reason": "length", "completion_tokens": 0}
    generated: list[TokenScore] = []
    if work is not None:
        summary, generated = await _generate(work, engine, request)
        summaries.setdefault("ttft_s", summary.get("ttft_s"))
        summaries["kv_bytes"] = summaries.get("kv_bytes", 0) + int(summary.get("kv_bytes") or 0)
    scores: list[TokenScore | None] = []
    if body.echo:
        scores = [None, *await _echo_scores(engine, ids)] if body.logprobs is not None else [None] * len(ids)
    scores += generated
    tokens = [s.token for s in generated]
    text, logprobs = await asyncio.to_thread(_choice_body, engine, body, ids, scores, tokens)
    choice = {"index": index, "text": text, "finish_reason": summary["finish_reason"], "logprobs": logprobs}
    return choice, len(ids), int(summary["completion_tokens"])


def _plan(body: CompletionRequest, engine: Engine) -> list[tuple[list[int], ChatWork | None]]:
    """Every prompt's ids and work, each checked before any runs."""
    max_tokens = _check(body, engine)
    return [(ids, _work(body, engine, ids, max_tokens)) for ids, _ in _prompts(body, engine)]


async def complete(body: CompletionRequest, engine: Engine, request: Request) -> dict[str, Any]:
    """The response to a completions request: one choice per prompt, in order."""
    prompts = await asyncio.to_thread(_plan, body, engine)
    choices, prompt_tokens, completion_tokens = [], 0, 0
    summaries: dict[str, Any] = {}  # the first answer's time to first token, every answer's KV bytes
    for index, prompt in enumerate(prompts):
        choice, used, made = await _choice(body, engine, request, prompt, index, summaries)
        choices.append(choice)
        prompt_tokens, completion_tokens = prompt_tokens + used, completion_tokens + made
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    work = next((w for _, w in prompts if w is not None), None)
    note_access(request.state, work, {**usage, **summaries})
    return {
        "id": "cmpl-" + secrets.token_hex(12),
        "object": "text_completion",
        "created": int(time.time()),
        "model": engine.config.model_name,
        "choices": choices,
        "usage": {**usage, "total_tokens": prompt_tokens + completion_tokens},
    }


def add_routes(app: FastAPI, engine: Engine) -> None:
    """Register ``POST /v1/completions`` on ``app``."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> dict[str, Any]:
        return await complete(body, engine, request)
