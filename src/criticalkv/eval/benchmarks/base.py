"""What a benchmark is to a sweep: its own options, validation, samples and run identity."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from criticalkv.eval.sample import Sample

#: every benchmark option under its flat name (``SweepConfig(qa_source=...)``, ``--qa-source``), with
#: its default; ``run.json`` lists them all, as it did before benchmarks had their own options
FLAT_DEFAULTS: dict[str, Any] = {"qa_source": None, "dataset": None, "data_dir": None, "longbench_e": False}

#: what a flat option set for a benchmark that lacks it says
_FOREIGN = {
    "qa_source": "--qa-source is a RULER option (qa_1, qa_2); the {name} benchmark has no use for it",
    "dataset": "--dataset selects the dataset benchmark; it does not go with the {name} benchmark",
    "data_dir": "--data-dir and --longbench-e are LongBench options; add --benchmark longbench",
    "longbench_e": "--data-dir and --longbench-e are LongBench options; add --benchmark longbench",
}


@dataclass(frozen=True)
class Draw:
    """Which samples a sweep asks of its benchmark."""

    tasks: list[str]
    lengths: list[int]
    #: per (task, length); ``None``: every sample there is (:attr:`Benchmark.default_samples` ``None``)
    samples: int | None
    seed: int


#: (task, length, index) of one sample
Slot = tuple[str, int, int]


class Benchmark(ABC):
    """A registered benchmark (see :mod:`criticalkv.eval.benchmarks`).

    Subclasses set :attr:`name` and :attr:`options_type` (a frozen dataclass whose fields carry
    their flat names, see :data:`FLAT_DEFAULTS`) and implement :meth:`samples`.
    """

    name: ClassVar[str]
    options_type: ClassVar[type[Any]]
    #: tokens to generate when the sweep sets no cap (``None``: each sample's own)
    max_new_tokens: ClassVar[int | None] = None
    #: ``True``: samples come at their own length (``--lengths`` does not apply), and one longer
    #: than the model accepts is skipped with a warning (and counted in the report), not an error
    per_sample_length: ClassVar[bool] = False
    #: samples per (task, length) when the sweep sets none (``None``: all of them, e.g. a user's own file)
    default_samples: ClassVar[int | None] = 10

    def options_from_flat(self, flat: Mapping[str, Any]) -> Any:
        """This benchmark's options from flat ones; raises ``ValueError`` for another benchmark's."""
        own = {f.name for f in fields(self.options_type)}
        for key, value in flat.items():
            if key not in own and value != FLAT_DEFAULTS[key]:
                raise ValueError(_FOREIGN[key].format(name=self.name))
        return self.options_type(**{k: v for k, v in flat.items() if k in own})

    def prepare(self, tasks: list[str] | None, options: Any) -> tuple[list[str], Any]:
        """Check the sweep's ``tasks`` and ``options`` before it starts; both as they will run."""
        return list(tasks or []), options

    def unusable(self, options: Any) -> list[dict[str, Any]]:
        """``skipped.jsonl`` lines of the benchmark's inputs that cannot be run at all (a dataset's
        malformed lines); none for generated benchmarks."""
        return []

    def identity(self, options: Any) -> dict[str, Any]:
        """What this benchmark adds to the run identity (by default: its options)."""
        return asdict(options)

    def planned(self, draw: Draw) -> list[Slot] | None:
        """Every sample the sweep will run, if known before loading any data (for progress)."""
        return None

    @abstractmethod
    def samples(self, draw: Draw, options: Any, tokenizer: Any) -> Iterator[tuple[int, Sample]]:
        """``(length, sample)`` in run order: sample-major, so an interrupted sweep has covered
        every task and length with fewer samples."""
