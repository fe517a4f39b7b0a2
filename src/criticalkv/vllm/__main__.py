"""``python -m criticalkv.vllm serve MODEL [--method M] [--budget B] [--window W] [vLLM's flags ...]``

Checks the plugin's options (a wrong one: one sentence, exit status 2, before vLLM starts), then
runs vLLM's OpenAI-compatible server in this process with the flags the plugin needs
(``--worker-cls``, ``--additional-config``, ``--enforce-eager``, ``--no-enable-prefix-caching``)
and every other flag passed on as given. ``--dry-run`` prints the vLLM command instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from criticalkv.budgets.resolve import parse_budget
from criticalkv.cache.prefill import DEFAULT_WINDOW
from criticalkv.vllm.engine import WORKER_CLS
from criticalkv.vllm.plugin_options import DEFAULT_BUDGET, DEFAULT_VLLM_METHOD, PluginOptions, supported_methods

SERVER = "vllm.entrypoints.openai.api_server"


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(
        prog="python -m criticalkv.vllm",
        description="Serve a model with vLLM, each prompt's KV cache compressed by a criticalkv method (docs/vllm.md).",
    )
    commands = parse.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="vLLM's OpenAI-compatible server with the plugin; other flags go to vLLM")
    serve.add_argument("model", help="a local model folder (what vLLM's --model takes)")
    serve.add_argument("--method", default=DEFAULT_VLLM_METHOD, help=f"one of: {', '.join(supported_methods())}")
    serve.add_argument("--budget", default=str(DEFAULT_BUDGET), help="a fraction of the prompt (0.2) or tokens (512)")
    serve.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="observation window in tokens")
    serve.add_argument("--dry-run", action="store_true", help="print the vLLM command and exit")
    return parse


def vllm_command(model: str, options: PluginOptions, rest: list[str]) -> list[str]:
    """The command that runs vLLM's server on ``model`` with the plugin and ``options``."""
    for flag in ("--worker-cls", "--additional-config", "--enable-prefix-caching", "--no-enforce-eager"):
        if any(arg == flag or arg.startswith(flag + "=") for arg in rest):
            raise ValueError(f"{flag} is set by the plugin (see docs/vllm.md); drop it")
    fixed = ["--model", model, "--worker-cls", WORKER_CLS, "--additional-config", json.dumps(options.as_config())]
    fixed += ["--enforce-eager", "--no-enable-prefix-caching"]
    return [sys.executable, "-m", SERVER, *fixed, *rest]


def main(argv: list[str] | None = None) -> int:
    args, rest = parser().parse_known_args(argv)
    try:
        options = PluginOptions(args.method, parse_budget(args.budget), args.window)
        command = vllm_command(args.model, options, rest)
    except ValueError as error:
        print(f"python -m criticalkv.vllm: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(command))
        return 0
    os.execv(command[0], command)  # vLLM's server replaces this process: signals reach it directly
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
