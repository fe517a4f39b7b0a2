"""The one orchestrator: every way criticalkv drives a model with a cache.

* :mod:`~criticalkv.runtime.attach` prepares a model (support check, attention routing);
* :mod:`~criticalkv.runtime.forward` holds the operations the harnesses share: prefill with
  capture, prefill into a compressing cache, appending tokens, teacher-forced log-probabilities,
  greedy continuation, and the one end-of-sequence rule;
* :mod:`~criticalkv.runtime.reconstruction` runs KVzip's context-reconstruction pass for methods
  that declare ``needs.reconstruction``;
* :mod:`~criticalkv.runtime.compress` is the one way to compress a prompt (:func:`compress_prompt`,
  :func:`prompt_states`): the only reader of what a method needs from the prefill;
* :mod:`~criticalkv.runtime.generate` answers questions about contexts (:func:`generate`);
* :mod:`~criticalkv.runtime.rows` decodes separate caches as the rows of one batch (:func:`decode_rows`;
  :func:`append_rows` appends several tokens per row, the batched start).
"""

from criticalkv.runtime.attach import attach
from criticalkv.runtime.compress import compress_prompt, compresses_in_prefill, prompt_states
from criticalkv.runtime.forward import (
    append_tokens,
    capture_prefill,
    continue_generation,
    decode_answers,
    eos_ids,
    input_device,
    prefill,
    prefill_into,
    teacher_forced_logprobs,
)
from criticalkv.runtime.generate import DEFAULT_WINDOWS, MODES, GenerationResult, Mode, check_mode, generate
from criticalkv.runtime.limits import check_positions, position_limit
from criticalkv.runtime.reconstruction import RepeatPrompt, reconstruct, repeat_prompt
from criticalkv.runtime.rows import append_rows, decode_rows

__all__ = [
    "DEFAULT_WINDOWS",
    "MODES",
    "GenerationResult",
    "Mode",
    "RepeatPrompt",
    "append_rows",
    "append_tokens",
    "attach",
    "capture_prefill",
    "check_mode",
    "check_positions",
    "compress_prompt",
    "compresses_in_prefill",
    "continue_generation",
    "decode_answers",
    "decode_rows",
    "eos_ids",
    "generate",
    "input_device",
    "position_limit",
    "prefill",
    "prefill_into",
    "prompt_states",
    "reconstruct",
    "repeat_prompt",
    "teacher_forced_logprobs",
]
