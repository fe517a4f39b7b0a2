"""Run one vLLM engine (plain, or with criticalkv's plugin) on a scenario and write what it saw as JSON.

Each engine runs in a process of its own (``python tests/helpers/vllm_engine.py SCENARIO.json OUT.json``):
vLLM keeps process-wide state, so two engines never share one. The engine core runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the scenario reads vLLM's own block pool and scheduler stats.

A scenario (JSON): ``model``, ``plugin`` (``null`` for plain vLLM, else ``{"method", "budget",
"window"}``), ``engine`` (vLLM keyword arguments), ``record`` (the plugin records kept positions) and
``phases``, each ``{"prompts": [[token ids], ...], "max_tokens": n}`` run one after the other. The
result, per phase: per prompt the greedy token ids; per engine step the free blocks of vLLM's pool,
the running / waiting requests of its scheduler stats, and each running request's computed tokens
and the blocks vLLM's manager holds for it (null blocks not counted). Then the plugin's stats and
the pool's size.
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
    llm = build(scenario)
    core = llm.llm_engine.engine_core.engine_core
    plugin = scenario.get("plugin") is not None
    if plugin and scenario.get("record"):
        llm.collective_rpc("criticalkv_record", args=(True,))
    phases = [run_phase(llm, core, phase, str(n)) for n, phase in enumerate(scenario["phases"])]
    return {
        "phases": phases,
        "total_blocks": core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1,  # without the null block
        "block_size": core.vllm_config.cache_config.block_size,
        "stats": _plugin_stats(llm) if plugin else None,
    }


def run_phase(llm: Any, core: Any, phase: dict[str, Any], tag: str) -> dict[str, Any]:
    """Submit a phase's prompts at once and step the engine until all finished (greedy, no early EOS)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=phase["max_tokens"], temperature=0.0, ignore_eos=True)
    prompts = phase["prompts"]
    for index, ids in enumerate(prompts):
        llm.llm_engine.add_request(f"{tag}.{index}", TokensPrompt(prompt_token_ids=ids), params)
    steps, tokens = [], {}
    while llm.llm_engine.has_unfinished_requests():
        for output in llm.llm_engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        steps.append(_step_record(core))
    free = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    return {"tokens": [tokens[f"{tag}.{i}"] for i in range(len(prompts))], "steps": steps, "free_after": free}


def _step_record(core: Any) -> dict[str, Any]:
    scheduler = core.scheduler
    stats = scheduler.make_stats()
    manager = scheduler.kv_cache_manager
    held = {}
    for request in scheduler.running:
        blocks = manager.get_blocks(request.request_id).blocks[0]
        held[request.request_id.rsplit("-", 1)[0]] = {
            "computed": request.num_computed_tokens,
            "prompt": request.num_prompt_tokens,
            "blocks": sum(not block.is_null for block in blocks),
            "preemptions": request.num_preemptions,
        }
    return {
        "free": manager.block_pool.get_num_free_blocks(),
        "running": stats.num_running_reqs,
        "waiting": stats.num_waiting_reqs,
        "held": held,
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
