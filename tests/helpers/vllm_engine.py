"""Run one vLLM engine (plain, or with criticalkv's plugin) on a scenario and write what it saw as JSON.

Each engine runs in a process of its own (``python tests/helpers/vllm_engine.py SCENARIO.json OUT.json``):
vLLM keeps process-wide state, so two engines never share one. The engine core runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the scenario reads vLLM's own block pool and scheduler stats.

A scenario (JSON): ``model``, ``plugin`` (``null`` for plain vLLM, else ``{"method", "budget",
"window"}``), ``engine`` (vLLM keyword arguments), ``prompts`` (lists of token ids), ``max_tokens``,
``record`` (the plugin records kept positions). The result: per prompt the greedy token ids; per
engine step the free blocks of vLLM's pool and the running / waiting requests of its scheduler
stats; the plugin's stats; the pool's size.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def build(scenario: dict[str, Any]) -> Any:
    from vllm import LLM

    engine = {"model": scenario["model"], "disable_log_stats": False, **scenario.get("engine", {})}
    if scenario.get("plugin") is None:
        return LLM(**{"enforce_eager": True, "enable_prefix_caching": False, **engine})
    from criticalkv.vllm import engine_args

    return LLM(**engine_args(**scenario["plugin"], **engine))


def run(scenario: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    llm = build(scenario)
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    plugin = scenario.get("plugin") is not None
    if plugin and scenario.get("record"):
        llm.collective_rpc("criticalkv_record", args=(True,))
    params = SamplingParams(max_tokens=scenario["max_tokens"], temperature=0.0, ignore_eos=True)
    prompts = scenario["prompts"]
    for index, ids in enumerate(prompts):
        llm.llm_engine.add_request(str(index), TokensPrompt(prompt_token_ids=ids), params)
    steps, tokens = [], {}
    while llm.llm_engine.has_unfinished_requests():
        for output in llm.llm_engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        stats = core.scheduler.make_stats()
        steps.append(
            {"free": pool.get_num_free_blocks(), "running": stats.num_running_reqs, "waiting": stats.num_waiting_reqs}
        )
    return {
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
        "steps": steps,
        "total_blocks": pool.num_gpu_blocks - 1,  # without the null block
        "block_size": core.vllm_config.cache_config.block_size,
        "stats": _plugin_stats(llm) if plugin else None,
    }


def _plugin_stats(llm: Any) -> dict[str, Any]:
    """The plugin's stats, its recorded requests under the ids the scenario gave them (vLLM appends
    a suffix of its own to each request id)."""
    stats = llm.collective_rpc("criticalkv_stats")[0]
    stats["kept"] = {key.rsplit("-", 1)[0]: value for key, value in stats["kept"].items()}
    return stats


def main(argv: list[str]) -> None:
    with open(argv[0]) as handle:
        scenario = json.load(handle)
    result = run(scenario)
    with open(argv[1], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1:])
