"""Evaluation: task generators, metrics and sweeps, in rooms, each with its face (``__all__``).

- :mod:`~criticalkv.eval.tasks`: RULER's generated tasks, the needle, your own JSONL files, metrics
- :mod:`~criticalkv.eval.longbench`: LongBench's datasets, truncation and metrics
- :mod:`~criticalkv.eval.benchmarks`: what a sweep runs by name, each with its own options dataclass
- :mod:`~criticalkv.eval.sweep`: :class:`~criticalkv.eval.sweep.SweepConfig` and the local runner
- :mod:`~criticalkv.eval.ray`: the same sweep on a Ray cluster
- :mod:`~criticalkv.eval.report`: ``summary.csv``, tables, figures and intervals of a finished run
- :mod:`~criticalkv.eval.lmeval`: lm-eval's ``criticalkv`` model

and three modules at the top: ``sample`` (what every task makes), ``store`` (the run folder's
records) and ``demo``. Code outside ``eval/`` imports a room's face, not the modules inside it.
"""
