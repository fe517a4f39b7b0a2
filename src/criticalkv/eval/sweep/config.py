"""What a sweep runs (:class:`SweepConfig`), shared by the local and the Ray runners and the evaluator."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import InitVar, asdict, dataclass, field
from pathlib import Path
from typing import Any

from criticalkv.budgets.resolve import Budget
from criticalkv.cache import DecodeBudget
from criticalkv.cache.decode import DEFAULT_INTERVAL, check_decode_budget
from criticalkv.cache.prefill import check_window
from criticalkv.cache.quantized import KVQuantization, default_group_size, quantization_for
from criticalkv.eval.benchmarks import FLAT_DEFAULTS, Benchmark, Draw, get_benchmark
from criticalkv.eval.sample import Sample
from criticalkv.eval.store import LAYOUT
from criticalkv.headscores.file import load_head_scores
from criticalkv.methods import get_method
from criticalkv.options import OptionError
from criticalkv.runs import check_folder_path
from criticalkv.runtime import DEFAULT_WINDOWS, check_mode
from criticalkv.scores.value_norms import NORM_PRECISIONS

#: the sweep's own settings in the run identity; the benchmark adds its part after them
IDENTITY_KEYS = ("benchmark", "model", "mode", "window", "seed", "max_new_tokens", "chat")
#: identity keys every folder names (``None`` where its benchmark lacks them), as before
#: benchmarks had their own options: folders written then resume unchanged
LEGACY_IDENTITY: dict[str, Any] = {"qa_source": None, "dataset": None}


@dataclass
class SweepConfig:
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
    #: storage precision of the compressed rows (``None``: the model's dtype); in the identity only when set
    kv_bits: int | None = None
    #: entries per quantization scale and zero point, and the newest tokens kept exact (``None``: the
    #: cache's defaults: 32 at 8 bits, 64 at 4 bits, and ``min(64, budget)``); need ``kv_bits``; in the
    #: identity only when set
    kv_group_size: int | None = None
    kv_residual: int | None = None
    #: hold each compressed cache at this many entries per KV head while it decodes and while the
    #: answer is teacher-forced (``None``: every generated token kept); in the identity only when set
    decode_budget: int | None = None
    #: re-select after this many new entries per head (``None``: 64 when ``decode_budget`` is set)
    decode_interval: int | None = None
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
        if self.kv_bits is not None:
            quantization_for(self.kv_bits, **self.quantization_options())
        elif self.kv_group_size is not None or self.kv_residual is not None:
            raise OptionError(
                "<kv_group_size> and <kv_residual> set how <kv_bits> quantizes: give <kv_bits> 8 or 4 too"
            )
        self._check_decode()

    def _check_decode(self) -> None:
        if self.decode_budget is None:
            if self.decode_interval is not None:
                raise OptionError(
                    "a decode interval (<decode_interval>) needs a decode budget: give <decode_budget> too, or drop "
                    "the interval"
                )
            return
        if self.decode_interval is None:
            self.decode_interval = DEFAULT_INTERVAL
        window = int(self.window or 0)
        for method in self.methods:
            if method != "full":  # the full cache is the reference: it keeps every entry
                check_decode_budget(get_method(method), window, self.decode_budget, self.decode_interval)

    def quantization_options(self) -> dict[str, int]:
        """The group size and residual given (``kv_group_size``/``kv_residual`` keywords of the cache)."""
        given = {"group_size": self.kv_group_size, "residual": self.kv_residual}
        return {k: v for k, v in given.items() if v is not None}

    def storage(self, model_config: Any = None) -> KVQuantization | None:
        """The quantization every compressed row is stored with (``None``: the model's dtype),
        checked against ``model_config`` (a group size must divide its head dimension)."""
        if self.kv_bits is None:
            return None
        return quantization_for(self.kv_bits, **self.quantization_options(), config=model_config)

    def decode(self) -> DecodeBudget | None:
        """The decode budget every compressed row is held at while it decodes, or ``None``."""
        if self.decode_budget is None:
            return None
        return DecodeBudget(self.decode_budget, self.decode_interval or DEFAULT_INTERVAL)

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
        if self.kv_bits is not None:
            identity["kv_bits"] = self.kv_bits
            # the group in effect, given or the bit width's default: defaults have changed (8 bits:
            # 64 then 32), so a folder recorded without it never resumes under another grouping
            group = self.kv_group_size
            identity["kv_group_size"] = default_group_size(self.kv_bits) if group is None else group
        if self.kv_residual is not None:
            identity["kv_residual"] = self.kv_residual
        if self.decode_budget is not None:  # likewise: a decode budget is another run
            identity["decode_budget"], identity["decode_interval"] = self.decode_budget, self.decode_interval
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
        """The flat config recorded in ``run.json`` (every benchmark option under its flat name)."""
        data = asdict(self)
        options = data.pop("options")
        for optional in LAYOUT.optional:  # absent when unset, as configs were recorded before the options existed
            if data[optional] is None:
                del data[optional]
        data["out"] = str(self.out)
        return {**data, **FLAT_DEFAULTS, **options}


def head_scores_fingerprint(path: str) -> str:
    """The content fingerprint of a head-score file (sha256 of its bytes, first 16 hex digits)."""
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


# the flat options are arguments only (they live in ``options``): reading one off a config fails
# instead of returning the class-level default
for _name in FLAT_DEFAULTS:
    delattr(SweepConfig, _name)
