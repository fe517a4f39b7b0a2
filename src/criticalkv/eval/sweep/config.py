"""What a sweep runs (:class:`SweepConfig`), shared by the local and the Ray runners and the evaluator."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import InitVar, asdict, dataclass, field
from pathlib import Path
from typing import Any

from criticalkv.budgets.resolve import Budget
from criticalkv.cache import CacheSpec
from criticalkv.cache.prefill import check_window
from criticalkv.cache.quantized import storage_options
from criticalkv.cache.spec_options import spec_keywords
from criticalkv.defaults import DECODE_OPTIONS, DEFAULT_METHOD, STORAGE_OPTIONS
from criticalkv.eval.benchmarks import FLAT_DEFAULTS, Benchmark, Draw, get_benchmark
from criticalkv.eval.results import LAYOUT
from criticalkv.eval.sample import Sample
from criticalkv.headscores.file import load_head_scores
from criticalkv.methods import Method, get_method
from criticalkv.runs import check_folder_path
from criticalkv.runtime import DEFAULT_WINDOWS, check_mode
from criticalkv.scores.value_norms import NORM_PRECISIONS

#: the sweep's own settings in the run identity; the benchmark adds its part after them
IDENTITY_KEYS = ("benchmark", "model", "mode", "window", "seed", "max_new_tokens", "chat")
#: identity keys every folder names (``None`` where its benchmark lacks them), as before
#: benchmarks had their own options: folders written then resume unchanged
LEGACY_IDENTITY: dict[str, Any] = {"qa_source": None, "dataset": None}
#: the cache options a sweep takes (its storage, then its decode budget), in the order ``run.json``
#: records them; the methods, budgets and window are the sweep's own fields
CACHE_OPTIONS: tuple[str, ...] = (*STORAGE_OPTIONS, *DECODE_OPTIONS)


@dataclass
class _SweepFields:
    """What a sweep runs. ``identity()`` must match to resume into an existing folder.

    ``tasks``: the benchmark's task names (``None``: its default, every RULER task or every
    LongBench dataset). ``options``: the benchmark's own options dataclass (e.g.
    :class:`~criticalkv.eval.benchmarks.RulerOptions`); left ``None``, it is built from the flat
    ``qa_source``, ``dataset``, ``data_dir`` and ``longbench_e`` (the command line's spelling).
    ``head_scores``: a head-score file for ``headkv``-style methods (``None``: the model's own);
    the identity then holds the file's content fingerprint, so an edited file is another run.
    """

    out: Path
    benchmark: str = "ruler"
    tasks: list[str] | None = None
    lengths: list[int] = field(default_factory=lambda: [1024])
    methods: list[str] = field(default_factory=lambda: ["full", "snapkv", "critical-snapkv", "adakv", "critical-adakv"])
    budgets: list[Budget] = field(default_factory=lambda: [0.1, 0.2, 0.4])
    #: per (task, length); ``None``: the benchmark's default (10 for RULER and LongBench, every line of a dataset file)
    samples: int | None = None
    mode: str = "question-aware"
    model: str = "default"
    window: int | None = None
    seed: int = 0
    max_new_tokens: int | None = None
    chat: bool = True
    #: dtype of the Critical selections' ``||V W_O||`` (``None``: each method's own, ``"auto"``);
    #: in the identity only when set, so folders made before the option resume unchanged
    norm_precision: str | None = None
    #: the cache's storage and decode options as given, by the names of
    #: :data:`~criticalkv.defaults.SPEC_OPTIONS` (``{"kv_bits": 4, "decode_budget": 256}``; text as
    #: a config file gives it is converted strictly), checked once by :meth:`CacheSpec.parse
    #: <criticalkv.cache.CacheSpec.parse>`; the sweep's own keywords too (``SweepConfig(kv_bits=4)``,
    #: as ``run.json`` records them). Each is in the identity only when set
    cache: dict[str, Any] = field(default_factory=dict)
    options: Any = None
    head_scores: str | None = None
    qa_source: InitVar[str | None] = None
    dataset: InitVar[str | None] = None
    data_dir: InitVar[str | None] = None
    longbench_e: InitVar[bool] = False

    def __post_init__(
        self, qa_source: str | None, dataset: str | None, data_dir: str | None, longbench_e: bool
    ) -> None:
        check_mode(self.mode)
        check_folder_path(self.out)
        self.window = check_window(DEFAULT_WINDOWS[self.mode] if self.window is None else self.window)
        flat = {"qa_source": qa_source, "dataset": dataset, "data_dir": data_dir, "longbench_e": longbench_e}
        self.options = self._options(flat)
        self.tasks, self.options = self.bench.prepare(self.tasks, self.options)
        if self.max_new_tokens is None:
            self.max_new_tokens = self.bench.max_new_tokens
        self._check_grid()
        if self.head_scores is not None:
            self.head_scores = str(self.head_scores)
            load_head_scores(self.head_scores)  # a missing or damaged file is refused before any work

    def _options(self, flat: dict[str, Any]) -> Any:
        bench = self.bench
        if self.options is None:
            return bench.options_from_flat(flat)
        if flat != FLAT_DEFAULTS:
            raise ValueError("give the benchmark's options either as options= or as flat arguments, not both")
        if not isinstance(self.options, bench.options_type):
            raise ValueError(f"the {bench.name} benchmark takes {bench.options_type.__name__}, not {self.options!r}")
        return self.options

    def _check_grid(self) -> None:
        for method in self.methods:
            get_method(method)
        if self.samples is not None and (isinstance(self.samples, bool) or self.samples < 1):
            raise ValueError("samples must be at least 1")
        if any(n < 128 for n in self.lengths):
            raise ValueError("lengths must be at least 128 tokens")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.norm_precision is not None and self.norm_precision not in NORM_PRECISIONS:
            raise ValueError(f"norm precision must be one of {', '.join(NORM_PRECISIONS)}, not {self.norm_precision!r}")
        self.cache = self._given_cache()
        template = self.spec()
        for method, budget in self.configs():  # every row checked as it will run
            row_spec(template, method, budget)

    def _given_cache(self) -> dict[str, Any]:
        """:attr:`cache` converted and checked (:meth:`CacheSpec.parse`), as the sweep records it: the
        storage options as given when quantized, the decode budget with the interval in effect."""
        self.cache = dict(self.cache or {})
        unknown = sorted(set(self.cache) - set(CACHE_OPTIONS))
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)} is not a cache option of a sweep; they are {', '.join(CACHE_OPTIONS)} "
                "(the methods, budgets and window are the sweep's own)"
            )
        given = spec_keywords(self.cache)
        spec = self._parse(given)
        recorded = spec.record()
        storage = {k: v for k, v in given.items() if k in STORAGE_OPTIONS} if spec.storage is not None else {}
        decode = {k: recorded[k] for k in DECODE_OPTIONS} if spec.decode is not None else {}
        both = {**storage, **decode}
        return {k: both[k] for k in CACHE_OPTIONS if k in both}

    def _parse(self, options: dict[str, Any], model_config: Any = None) -> CacheSpec:
        compressing = [m for m in self.methods if get_method(m).compresses] or [DEFAULT_METHOD]
        defaults = {"method": compressing[0], "window": self.window}
        return CacheSpec.parse(options, defaults=defaults, config=model_config)

    def spec(self, model_config: Any = None) -> CacheSpec:
        """The sweep's template spec: its decode budget and storage at its window (checked against
        ``model_config``, the model's: a group size must divide its head dimension), for its first
        compressing method; :func:`row_spec` makes each row of it."""
        return self._parse(self.cache, model_config)

    @property
    def bench(self) -> Benchmark:
        """The registered benchmark this sweep runs."""
        return get_benchmark(self.benchmark)

    @property
    def draw(self) -> Draw:
        """Which samples the sweep asks of its benchmark."""
        samples = self.bench.default_samples if self.samples is None else self.samples
        return Draw(list(self.tasks or []), list(self.lengths), samples, self.seed)

    def identity(self) -> dict[str, Any]:
        """What must match to resume: the sweep's settings, then the benchmark's part."""
        own = {k: getattr(self, k) for k in IDENTITY_KEYS}
        identity = {**own, **LEGACY_IDENTITY, **self.bench.identity(self.options)}
        if self.norm_precision is not None:  # absent otherwise: folders made without the option keep their identity
            identity["norm_precision"] = self.norm_precision
        spec = self.spec()
        # the storage in effect (the group given or the bit width's default: defaults have changed,
        # 8 bits: 64 then 32, so a folder recorded without it never resumes under another grouping),
        # the residual when given, the decode budget and interval: each absent when unset, so
        # folders made before the option resume unchanged
        identity.update({k: v for k, v in storage_options(spec.storage).items() if v is not None})
        identity.update({k: v for k, v in self.cache.items() if k in DECODE_OPTIONS})
        if self.head_scores is not None:
            identity["head_scores"] = head_scores_fingerprint(self.head_scores)
        return identity

    def configs(self) -> list[tuple[str, Budget]]:
        """(method, budget) pairs: ``full`` once at budget 1.0, every other method at every budget."""
        out: list[tuple[str, Budget]] = [("full", 1.0)] if "full" in self.methods else []
        return out + [(m, b) for m in self.methods if m != "full" for b in self.budgets]

    def iter_samples(self, tokenizer: Any) -> Iterator[tuple[int, Sample]]:
        """``(length, sample)`` of the whole sweep, in run order."""
        return self.bench.samples(self.draw, self.options, tokenizer)

    def to_json(self) -> dict[str, Any]:
        """The flat config recorded in ``run.json`` (every cache option and benchmark option under
        its flat name; those of :data:`~criticalkv.eval.results.LAYOUT`'s optional ones that are unset
        left out, as configs were recorded before the options existed)."""
        data = asdict(self)
        options = data.pop("options")
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(value if key == "cache" else {key: value})  # the cache options flat, in place
        flat = {k: v for k, v in flat.items() if k not in LAYOUT.optional or v is not None}
        flat["out"] = str(self.out)
        return {**flat, **FLAT_DEFAULTS, **options}


def row_spec(template: CacheSpec, method: str | Method, budget: Budget) -> CacheSpec:
    """The spec of one (method, budget) row of the sweep whose template is ``template`` (see
    :meth:`SweepConfig.spec`): its decode budget and storage; the full cache, the reference, keeps
    every entry (no decode budget) in the same storage."""
    method = get_method(method)
    if not method.compresses:
        return CacheSpec(method, budget, template.window, storage=template.storage)
    return template.replaced(method=method, budget=budget)


def head_scores_fingerprint(path: str) -> str:
    """The content fingerprint of a head-score file (sha256 of its bytes, first 16 hex digits)."""
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


class SweepConfig(_SweepFields):
    __doc__ = _SweepFields.__doc__

    def __init__(self, out: Path, **settings: Any) -> None:
        """The fields by name; the cache options may be given flat too (``kv_bits=4``, each of
        :data:`CACHE_OPTIONS`), as ``run.json`` records them: ``SweepConfig(**recorded)`` rebuilds a
        recorded sweep."""
        flat = {name: settings.pop(name) for name in CACHE_OPTIONS if name in settings}
        super().__init__(out, cache={**settings.pop("cache", {}), **flat}, **settings)


# the flat options are arguments only (they live in ``options``): reading one off a config fails
# instead of returning the class-level default
for _name in FLAT_DEFAULTS:
    delattr(_SweepFields, _name)
