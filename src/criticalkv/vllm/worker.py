"""The vLLM worker that compresses: vLLM's CPU worker with the plugin's runner steps.

Name it with ``worker_cls="criticalkv.vllm.worker.CriticalKVWorker"`` (``--worker-cls``), as
:func:`criticalkv.vllm.engine_args` does. It checks the engine's configuration before anything is
built, so a wrong option is one sentence at start-up.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.worker.cpu_worker import CPUWorker

from criticalkv.vllm import runner as compressing
from criticalkv.vllm.engine import check_engine
from criticalkv.vllm.plugin_options import PluginOptions

#: under vLLM's logger, which vLLM configures in every process it starts: the start line shows in its log
logger = init_logger("vllm.criticalkv")


class CriticalKVWorker(CPUWorker):
    """vLLM's CPU worker whose model runner compresses each prompt (see :mod:`criticalkv.vllm`)."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        self.criticalkv_options: PluginOptions = check_engine(vllm_config)
        logger.info("criticalkv: compressing every prompt with %s", self.criticalkv_options.text())
        super().__init__(vllm_config, *args, **kwargs)

    def init_device(self) -> None:
        super().init_device()
        compressing.attach(self.model_runner, self.criticalkv_options)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        compressing.start(self.model_runner)

    # --- through LLM.collective_rpc (the tests and benchmarks read these) --------------------------
    def criticalkv_stats(self) -> dict[str, Any]:
        """What the plugin did in this worker: requests compressed and left whole, entries before and
        after per (layer, KV head), seconds spent selecting and moving, and kept positions if recorded."""
        stats = self.model_runner.criticalkv.stats
        return {
            "compressed": stats.compressed,
            "left_whole": stats.left_whole,
            "entries_before": stats.entries_before,
            "entries_after": stats.entries_after,
            "seconds": stats.seconds,
            "kept": dict(stats.kept),
        }

    def criticalkv_record(self, on: bool = True) -> None:
        """Record each compressed request's kept positions per (layer, KV head) (for tests)."""
        self.model_runner.criticalkv.record = on
