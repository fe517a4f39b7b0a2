"""Shared fixtures: tiny random Llama, Mistral and Qwen2 models (no download), and the test device.

The ``--device`` option
-----------------------
``pytest --device DEVICE`` runs the device tests on ``DEVICE``, any torch device string: ``cpu``
(the default), ``cuda``, ``cuda:1``, ``mps``, ``xpu``. The device tests are the oracle
(``tests/cache/test_cache_oracle.py``), the library side of the loop-based references
(``tests/methods/test_reference_critical.py``; the references themselves run on the CPU in float64), the
selection invariants (``tests/methods/test_selection.py``), the memory tests (``tests/cache/test_memory.py``)
and the compiled Triton kernel (``tests/ops/test_triton_ragged.py``, CUDA only).
They take the session fixture ``device``, build their tiny models and tensors on the CPU with the
usual seeds (so every device sees the same weights and inputs) and move them there. Every other
test runs on the CPU whatever the option says. For example::

    PYTHONPATH=src python -m pytest --device cuda tests/cache/test_cache_oracle.py \
        tests/methods/test_reference_critical.py tests/methods/test_selection.py tests/cache/test_memory.py \
        tests/ops/test_triton_ragged.py -m "not slow"

A device this machine lacks (``torch.cuda.is_available()`` false, ``cuda:3`` on a one-GPU machine)
skips the device tests with the reason; a string that is no torch device, or a device type torch
cannot compute on here (``meta``), stops the run with a usage error. Tolerances are the CPU ones
on the CPU; on an accelerator some are loosened by :func:`tolerance`, with the reason beside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

pytest_plugins = ("pytester",)  # tests/repo/test_device_option.py runs pytest on the option

VOCAB = 101
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="torch device for the oracle, reference, selection and memory tests (cpu, cuda, cuda:1, mps, ...)",
    )


def parse_device(text: str) -> torch.device:
    """``text`` as a torch device tests can compute on, or a usage error saying why not."""
    try:
        device = torch.device(text)
    except RuntimeError as error:
        raise pytest.UsageError(
            f"--device {text!r} is not a torch device ({error}); try cpu, cuda, cuda:1 or mps"
        ) from None
    if not callable(getattr(getattr(torch, device.type, None), "is_available", None)):
        raise pytest.UsageError(f"--device {text!r}: torch cannot run tests on {device.type!r}; try cpu, cuda or mps")
    return device


def unavailable(device: torch.device) -> str | None:
    """Why ``device`` is missing on this machine, or ``None`` when tests can use it."""
    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type)
    if not backend.is_available():
        return f"--device {device}: no {device.type} device here (torch.{device.type}.is_available() is False)"
    count = backend.device_count() if callable(getattr(backend, "device_count", None)) else 1
    if device.index is not None and device.index >= count:
        return f"--device {device}: this machine has {count} {device.type} device(s)"
    return None


def pytest_configure(config: pytest.Config) -> None:
    parse_device(config.getoption("--device"))  # a bad string stops the run before collection


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    """The ``--device`` to run on; the test is skipped when this machine does not have it."""
    chosen = parse_device(request.config.getoption("--device"))
    reason = unavailable(chosen)
    if reason is not None:
        pytest.skip(reason)
    return chosen


def tolerance(cpu: float, device: torch.device, accelerator: float | None = None) -> float:
    """``cpu`` on the CPU (the tolerances as they always were); on an accelerator ``accelerator``
    (default ten times ``cpu``): its attention and matmul kernels sum float32 in another order than
    the CPU (and may use TF32 where enabled), which moves logits by more than the CPU's rounding."""
    if device.type == "cpu":
        return cpu
    return 10 * cpu if accelerator is None else accelerator


def make_tiny(arch: str, seed: int = 0, device: torch.device | str = "cpu") -> PreTrainedModel:
    """A tiny random causal LM of architecture ``arch`` (GQA: 6 query heads, 2 KV heads), built
    on the CPU (the same weights for every device), then moved to ``device``."""
    torch.manual_seed(seed)
    model: PreTrainedModel
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_COMMON, head_dim=16))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**_COMMON, head_dim=16, sliding_window=None))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_COMMON, use_sliding_window=False))
    else:
        raise ValueError(arch)
    return model.to(device).eval()


ARCHS = ["llama", "mistral", "qwen2"]


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return make_tiny(request.param)


@pytest.fixture(scope="session")
def tiny_llama() -> PreTrainedModel:
    return make_tiny("llama")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a saved tiny Llama and the character tokenizer: a model the CLI loads by path."""
    from tests.helpers.tiny_tokenizer import char_tokenizer

    folder = tmp_path_factory.mktemp("tiny-model")
    make_tiny("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def padded_batch(
    lengths: list[int], seed: int = 0, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random left-padded ``input_ids`` and ``attention_mask`` with the given real lengths (drawn on
    the CPU, then moved to ``device``)."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), t), generator=g)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, t - n :] = 1
        ids[i, : t - n] = 0
    return ids.to(device), mask.to(device)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """Tiny tensors run faster without torch's thread pool (and do not fight a busy machine)."""
    from tests.helpers.random_state import one_thread

    with one_thread():
        yield
