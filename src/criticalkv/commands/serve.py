"""``criticalkv serve``: an OpenAI-compatible HTTP server over compressed, stored contexts."""

from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from criticalkv.commands.cache_options import add_cache_arguments, spec_from_args
from criticalkv.commands.common import (
    UsageError,
    add_model_arguments,
    budget_arg,
    method_arg,
    methods_arg,
    require_extra,
)
from criticalkv.commands.inputs import output_folder
from criticalkv.defaults import DEFAULT_METHOD

NAME = "serve"
HELP = "serve an OpenAI-compatible API over compressed, stored contexts (see docs/serving.md)"
API_KEY_ENV = "CRITICALKV_API_KEY"

if TYPE_CHECKING:
    from criticalkv.serve import ServerConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--method", type=method_arg, default=DEFAULT_METHOD, help="the default method")
    p.add_argument("--methods", type=methods_arg, default=[], help="other methods a request may ask for (a,b,...)")
    p.add_argument("--budget", type=budget_arg, default=0.2, help="the default budget, a fraction of the context")
    p.add_argument("--min-budget", type=float, default=0.01, help="the smallest budget a request may ask for")
    p.add_argument("--window", type=int, default=64, help="the default observation window (tokens)")
    p.add_argument("--max-window", type=int, default=512, help="the largest observation window a request may ask for")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens one answer may ask for")
    p.add_argument("--memory-cap", type=float, default=2048, help="MiB of stored contexts' KV held in memory")
    p.add_argument(
        "--max-body-mib", type=float, default=16, help="request bodies above this many MiB are refused (413) unread"
    )
    p.add_argument(
        "--max-sessions", type=int, default=16, help="requests admitted at once; one more waits for a slot, then 429"
    )
    p.add_argument(
        "--admission-wait",
        type=float,
        default=30.0,
        help="seconds a request waits for a slot when --max-sessions are taken, before its 429 (0: at once)",
    )
    p.add_argument("--max-batch", type=int, default=8, help="answers decoded at once as one batch (per replica)")
    p.add_argument(
        "--offload-prompt-tokens",
        type=int,
        default=128,
        help="chat prompts of at least this many tokens are compressed beside the decode steps (0: all)",
    )
    p.add_argument(
        "--prefill-batch-tokens",
        type=int,
        default=4096,
        help="prompts that arrive together are compressed in one prefill of at most this many (padded) tokens",
    )
    p.add_argument(
        "--prefill-gather-ms",
        type=float,
        default=50,
        help="an idle compressor waits this long for prompts sent at the same moment, to batch them",
    )
    p.add_argument("--store", type=Path, default=None, help="folder of stored contexts (default: a temporary one)")
    add_cache_arguments(p, decode=False)  # server-wide: every compressed context and answer cache
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
    p.add_argument("--force", action="store_true", help="listen beyond localhost without an API key")
    ray = p.add_argument_group("Ray Serve (scale out; needs pip install 'ray[serve]' and a shared --store)")
    ray.add_argument("--ray", action="store_true", help="serve as a Ray Serve deployment of --replicas replicas")
    ray.add_argument("--replicas", type=int, default=1, help="replicas, each loading the model once")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    ray.add_argument("--ray-address", default="local", help="'local' starts a Ray cluster here; or a cluster's")


def run(args: argparse.Namespace) -> int:
    if args.ray:
        require_extra("serve --ray", "ray-serve", "fastapi", "uvicorn", "ray")
    require_extra("serve", "serve", "fastapi", "uvicorn")  # one sentence, before the model loads
    from criticalkv.serve import Engine, ServerConfig, build_app, check_binding
    from criticalkv.serve.errors import APIError

    # a key read from a file or a secret store often ends in a newline: no client sends it
    api_key = (args.api_key or os.environ.get(API_KEY_ENV) or "").strip() or None
    check_binding(args.host, api_key, args.force)
    _check_limits(args)
    if args.store is not None:
        output_folder(args.store, "--store")  # a file or a read-only mount: a sentence, not a traceback
    config = ServerConfig(
        model_name=args.model,
        spec=spec_from_args(args, args.method, args.budget, args.window),  # the server's default cache
        methods=tuple(args.methods),
        min_budget=args.min_budget,
        max_window=args.max_window,
        max_new_tokens=args.max_new_tokens,
        memory_cap_bytes=int(args.memory_cap * 2**20),
        max_body_bytes=int(args.max_body_mib * 2**20),
        max_sessions=args.max_sessions,
        admission_wait_s=args.admission_wait,
        max_batch=args.max_batch,
        offload_prompt_tokens=args.offload_prompt_tokens,
        prefill_batch_tokens=args.prefill_batch_tokens,
        prefill_gather_s=args.prefill_gather_ms / 1000,
        store=args.store,
        api_key=api_key,
    )
    try:
        config.spec_for(None, None, None)  # the defaults must lie within the limits
    except APIError as error:
        raise UsageError(error.message) from error
    if args.ray:
        return _run_on_ray(args, config)
    from criticalkv.models import load_model
    from criticalkv.serve.listen import serve_app

    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    engine = Engine(model, tokenizer, config)  # refuses a group size that does not divide the head dimension
    logging.getLogger(__name__).info("serving %s on http://%s:%d", args.model, args.host, args.port)
    serve_app(build_app(engine), args.host, args.port)  # prints "listening on http://HOST:PORT" once bound
    return 0


def _check_limits(args: argparse.Namespace) -> None:
    """Every numeric option in range and finite, each refusal one sentence naming its flag."""
    if isinstance(args.budget, int):
        raise UsageError("--budget must be a fraction of the context in (0, 1] for the server")
    for flag, value in (
        ("--max-new-tokens", args.max_new_tokens),
        ("--max-sessions", args.max_sessions),
        ("--max-batch", args.max_batch),
        ("--prefill-batch-tokens", args.prefill_batch_tokens),
    ):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1")
    if args.offload_prompt_tokens < 0:
        raise UsageError("--offload-prompt-tokens must be 0 (every prompt) or a positive number of tokens")
    if not math.isfinite(args.prefill_gather_ms) or not 0 <= args.prefill_gather_ms <= 10_000:
        raise UsageError(f"--prefill-gather-ms must be between 0 and 10000 milliseconds, not {args.prefill_gather_ms}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be a TCP port between 0 and 65535, not {args.port}")
    if not math.isfinite(args.max_body_mib) or args.max_body_mib <= 0:
        raise UsageError(f"--max-body-mib must be a finite positive number of MiB, not {args.max_body_mib}")
    if not math.isfinite(args.memory_cap) or args.memory_cap <= 0:
        raise UsageError(f"--memory-cap must be a finite positive number of MiB, not {args.memory_cap}")
    if not math.isfinite(args.admission_wait) or args.admission_wait < 0:
        raise UsageError(f"--admission-wait must be a finite number of seconds >= 0, not {args.admission_wait}")
    _check_decode_env()


def _check_decode_env() -> None:
    """``CRITICALKV_DECODE`` read now, not at the first request (which would answer 500 on every one)."""
    from criticalkv.ops.ragged_decode import DECODE_ENV, DECODE_MODES

    mode = os.environ.get(DECODE_ENV, "auto")
    if mode not in DECODE_MODES:
        raise UsageError(f"{DECODE_ENV} must be one of {', '.join(DECODE_MODES)}, not {mode!r}; unset it or fix it")


def _run_on_ray(args: argparse.Namespace, config: ServerConfig) -> int:
    if args.store is None:
        raise UsageError("--ray needs --store: a folder every replica can read and write (the shared contexts)")
    if args.replicas < 1 or args.replica_cpus <= 0:
        raise UsageError("--replicas must be at least 1 and --replica-cpus positive")
    try:
        from criticalkv.serve import ray_deployment
    except ImportError as error:
        raise UsageError(f"--ray needs Ray Serve: pip install 'ray[serve]' ({error})") from error
    application = ray_deployment.build_application(
        config, args.model, device=args.device, dtype=args.dtype, replicas=args.replicas, num_cpus=args.replica_cpus
    )
    ray_deployment.serve_forever(application, args.host, args.port, address=args.ray_address)
    return 0
