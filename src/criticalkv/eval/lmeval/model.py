"""lm-eval's ``criticalkv`` model: lm-eval's own Hugging Face model (``HFLM``) whose prompts are
compressed by a :class:`~criticalkv.cache.CacheSpec` before it scores or decodes from them.

Everything lm-eval does around the model is ``HFLM``'s: tokenisation, chat templates, left
truncation to ``max_length``, request ordering, batching, stop sequences and post-processing. Only
the two places where the model runs on a prompt differ:

* ``generate_until`` (:meth:`CriticalKVLM._model_generate`): each batch row's prompt is compressed
  question-aware (its last ``window`` tokens are the observation window) by
  :func:`criticalkv.runtime.compress_prompt`, then decoded greedily on the compressed cache up to
  ``max_gen_toks`` tokens or lm-eval's ``until``; padding is never kept;
* ``loglikelihood`` (:meth:`CriticalKVLM._loglikelihood_tokens`): the context is compressed once
  (every continuation of one context shares it), then each continuation is teacher-forced on a fork.

A prompt the spec cannot compress (:meth:`CacheSpec.compressible
<criticalkv.cache.CacheSpec.compressible>`: each head's budget, ``floor(budget * tokens)``, below
the window, or an exact residual longer than it) is kept whole, and counted.
``loglikelihood_rolling`` is ``HFLM``'s: disjoint windows whose context is one token, so each
window is scored on its own tokens with nothing to compress (the full cache), whatever the method.
With ``method=full`` the outputs and scores are ``--model hf``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils_hf import stop_sequences_criteria
from lm_eval.utils import simple_parse_args_string

from criticalkv.cache import CacheSpec, CompressedCache, bind_spec
from criticalkv.eval.lmeval.model_args import LMEvalOptions, available_device, check_compresses_some, merged_args
from criticalkv.eval.lmeval.usage import KVUsage
from criticalkv.methods import get_method
from criticalkv.models import load_model
from criticalkv.runtime import attach, compress_prompt, continue_generation, input_device, teacher_forced_logprobs

logger = logging.getLogger(__name__)


@register_model("criticalkv")
class CriticalKVLM(HFLM):
    """``lm_eval --model criticalkv --model_args pretrained=default,method=critical-adakv,budget=0.2``.

    ``pretrained``: ``default`` (the built-in SmolLM2-135M-Instruct), a local folder or a hub id;
    the cache options (:data:`~criticalkv.defaults.SPEC_OPTIONS`: the method, budget and window,
    the decode budget, the storage) as :meth:`CacheSpec.parse` takes them; ``dtype``,
    ``device``, ``batch_size`` and ``max_length`` as lm-eval's ``hf`` model takes them.
    """

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> CriticalKVLM:
        """lm-eval's ``--model_args`` with its own ``--batch_size``, ``--max_batch_size`` and
        ``--device`` (which it always passes): a name in ``model_args`` wins (see :func:`merged_args`)."""
        return cls(**merged_args(simple_parse_args_string(arg_string), additional_config))

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> CriticalKVLM:
        """As :meth:`create_from_arg_string`, from a dictionary of model arguments."""
        return cls(**merged_args(dict(arg_dict), additional_config))

    def __init__(self, pretrained: str = "default", **model_args: Any) -> None:
        options = LMEvalOptions.parse(pretrained=pretrained, **model_args)
        device = available_device(options.device)
        model, tokenizer = load_model(options.pretrained, device=device, dtype=options.dtype)
        attach(model)
        self.spec = bind_spec(options.spec, model)  # its storage checked against the model's head dimension
        self.usage = KVUsage()
        self.source = options.pretrained
        super().__init__(
            pretrained=model,
            tokenizer=tokenizer,
            batch_size=options.batch_size,
            max_batch_size=options.max_batch_size,
            max_length=options.max_length,
        )
        check_compresses_some(self.spec, self.max_length)

    # --- which spec a prompt gets -----------------------------------------------------------
    def _whole(self, shortest: int) -> CacheSpec:
        """The full cache for prompts of at least ``shortest`` tokens (the window within them)."""
        return CacheSpec(get_method("full"), 1.0, min(self.spec.window, shortest), storage=self.spec.storage)

    def _compress(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[CompressedCache, torch.Tensor]:
        """Compress the (B, T) prompts (all compressible, or all kept whole: one spec for the batch)."""
        lengths = mask.sum(dim=1)
        compresses = self.spec.compressible(int(lengths.min()))
        spec = self.spec if compresses else self._whole(int(lengths.min()))
        cache, last = compress_prompt(self.model, ids, mask, spec)
        self.usage.add(cache, rows=int(ids.shape[0]), whole=not compresses)
        return cache, last

    # --- generate_until -----------------------------------------------------------------------
    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **kwargs: Any) -> torch.Tensor:
        """``HFLM``'s generation contract (the (B, T) left-padded prompts in, (B, T + n) ids out,
        finished rows padded), each row's prompt compressed first; rows of one spec run as one batch."""
        mask = kwargs.pop("attention_mask", None)
        mask = torch.ones_like(context) if mask is None else mask
        _check_greedy(kwargs)
        lengths = mask.sum(dim=1).tolist()
        groups: dict[bool, list[int]] = {}
        for row, length in enumerate(lengths):
            groups.setdefault(self.spec.compressible(int(length)), []).append(row)
        pad = self._pad_id()
        out = torch.full((context.shape[0], max_length), pad, dtype=torch.long, device=context.device)
        out[:, : context.shape[1]] = context
        for rows in groups.values():
            new = self._generate_rows(context[rows], mask[rows], max_length - context.shape[1], stop)
            out[rows, context.shape[1] : context.shape[1] + new.shape[1]] = new.to(out.device)
        return out

    def _generate_rows(self, ids: torch.Tensor, mask: torch.Tensor, max_new: int, stop: list[str]) -> torch.Tensor:
        """(B, n <= max_new) greedy tokens after the compressed prompts ``ids`` (common padding
        dropped), padded after each row's end-of-sequence token as ``model.generate`` pads."""
        width = int(mask.sum(dim=1).max())
        device = input_device(self.model)
        ids, mask = ids[:, -width:].to(device), mask[:, -width:].to(device)
        cache, last = self._compress(ids, mask)
        criteria = stop_sequences_criteria(self.tokenizer, stop, width, int(ids.shape[0]))
        first, pad = last.argmax(-1), self._pad_id()
        new = continue_generation(
            self.model, cache, ids, mask, first, max_new, stopping_criteria=criteria, pad_token_id=pad
        )
        return _pad_after_eos(new, self._generation_eos(), pad)

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else int(self.tokenizer.eos_token_id)

    def _generation_eos(self) -> set[int]:
        """The end-of-sequence ids ``model.generate`` stops a row at (its generation config's)."""
        value = self.model.generation_config.eos_token_id
        if value is None:
            return set()
        return {int(value)} if isinstance(value, int) else {int(v) for v in value}

    # --- loglikelihood ------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: Sequence[Any], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        """(log-likelihood, is-greedy) of each ``(key, context_enc, continuation_enc)``, in order:
        the context compressed once, each of its continuations teacher-forced on a fork."""
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        splits = []
        for index, (_, context_enc, continuation_enc) in enumerate(requests):
            head, continuation = self._split(list(context_enc), list(continuation_enc))
            splits.append(continuation)
            by_prompt.setdefault(tuple(head), []).append(index)
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for key, indices in by_prompt.items():
            for index, answer in zip(indices, self._score(list(key), [splits[i] for i in indices]), strict=True):
                results[index] = answer
                if requests[index][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[index][0], answer)
        return results

    def _split(self, context_enc: list[int], continuation_enc: list[int]) -> tuple[list[int], list[int]]:
        """``HFLM``'s truncation (the last ``max_length`` tokens of context + continuation, the last
        token not fed): the prompt to compress (up to the token predicting the continuation's first)
        and the continuation."""
        if not continuation_enc:
            raise ValueError("a loglikelihood request has an empty continuation; lm-eval's tasks never send one")
        fed = (context_enc + continuation_enc)[-(self.max_length + 1) :][:-1]
        prompt_len = len(fed) - len(continuation_enc) + 1
        if prompt_len < 1:
            raise ValueError(
                f"a continuation of {len(continuation_enc)} tokens does not fit in max_length={self.max_length}; "
                "raise max_length"
            )
        return fed[:prompt_len], continuation_enc

    @torch.no_grad()
    def _score(self, prompt: list[int], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """Compress ``prompt`` once; each continuation's summed log-probability and whether it is
        the greedy one, teacher-forced on a fork of the compressed cache."""
        ids = torch.tensor([prompt], dtype=torch.long, device=input_device(self.model))
        mask = torch.ones_like(ids)
        cache, last = self._compress(ids, mask)
        answers = []
        for continuation in continuations:
            logprobs = teacher_forced_logprobs(self.model, cache.fork(), mask, continuation, len(continuation), last)
            target = torch.tensor(continuation, device=logprobs.device)
            picked = logprobs[0].gather(-1, target[:, None])[:, 0]
            greedy = bool((logprobs[0].argmax(-1) == target).all())
            answers.append((float(picked.sum()), greedy))
        return answers

    # --- what the results carry -----------------------------------------------------------------
    def get_model_info(self) -> dict[str, Any]:
        """``HFLM``'s model info and a ``criticalkv`` entry: the spec and the KV bytes measured."""
        info = super().get_model_info()
        summary = self.usage.summary(compressing=self.spec.method.compresses)
        if summary["compressed_nothing"]:
            logger.warning(
                "method %s compressed NONE of the %d prompts of this run: every prompt was kept whole (the "
                "full cache), so these results are the full cache's, not %s's at budget %s",
                self.spec.method.name,
                summary["prompts"],
                self.spec.method.name,
                self.spec.budget,
            )
        info["criticalkv"] = {"pretrained": self.source, **self.spec.record(), **summary}
        return info


def _check_greedy(kwargs: dict[str, Any]) -> None:
    """``kwargs`` must ask for greedy decoding (what the compressed decode implements)."""
    temperature = kwargs.pop("temperature", 0.0)
    do_sample = kwargs.pop("do_sample", None)
    if do_sample or (temperature not in (None, 0, 0.0) and do_sample is not False):
        raise ValueError(
            f"criticalkv decodes greedily, but this task asks for sampling (do_sample={do_sample}, "
            f"temperature={temperature}); pass --gen_kwargs do_sample=False,temperature=0"
        )
    for key in ("top_p", "top_k"):
        kwargs.pop(key, None)
    if kwargs:
        raise ValueError(
            f"criticalkv does not take the generation settings {', '.join(sorted(kwargs))}; it takes until, "
            "max_gen_toks, and greedy decoding (do_sample=False, temperature=0)"
        )


def _pad_after_eos(new: torch.Tensor, eos: set[int], pad: int) -> torch.Tensor:
    """``new`` (B, n) with every token after a row's first end-of-sequence token set to ``pad``."""
    if not eos:
        return new
    is_eos = torch.isin(new, torch.tensor(sorted(eos), device=new.device))
    after = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return new.masked_fill(after, pad)
