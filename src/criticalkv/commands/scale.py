"""``criticalkv eval`` options for large runs: model sharding (``--device-map``) and Ray (``--ray``)."""

from __future__ import annotations

import argparse
from typing import Any

from criticalkv.commands.common import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device-map",
        default=None,
        help="'auto': shard the model across the visible GPUs (transformers' device_map); not with --device",
    )
    group = p.add_argument_group("Ray (pip install -e '.[ray]')")
    group.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the sweep on a Ray cluster: its ADDRESS ('auto', 'ray://head:10001'), or none for "
        "$RAY_ADDRESS or a new local cluster",
    )
    group.add_argument("--ray-cpus-per-worker", type=float, default=1.0, help="CPUs of each worker (default 1)")
    group.add_argument("--ray-gpus-per-worker", type=float, default=0.0, help="GPUs of each worker (default 0)")
    group.add_argument("--ray-workers", type=int, default=None, help="workers to start (default: as many as fit)")
    group.add_argument(
        "--ray-samples-per-unit", type=int, default=1, help="samples per work unit (scheduling and retry granularity)"
    )


def run_sweep_from_args(args: argparse.Namespace, config: Any) -> None:
    """Run ``config`` here (loading the model) or, with ``--ray``, on a Ray cluster."""
    from criticalkv.runs import DEFAULT_WAIT

    wait = DEFAULT_WAIT if args.wait is None else args.wait
    if args.ray is None:
        from criticalkv.eval.sweep import run_sweep
        from criticalkv.models import load_model

        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, device_map=args.device_map)
        run_sweep(config, model, tokenizer, wait=wait)
        return
    from criticalkv.eval.ray import RayNotInstalled, RayOptions, run_sweep_ray

    options = RayOptions(
        address=args.ray or None,
        cpus_per_worker=args.ray_cpus_per_worker,
        gpus_per_worker=args.ray_gpus_per_worker,
        workers=args.ray_workers,
        samples_per_unit=args.ray_samples_per_unit,
        device=args.device,
        dtype=args.dtype,
        device_map=args.device_map,
    )
    try:
        run_sweep_ray(config, options, wait=wait)
    except RayNotInstalled as error:
        raise UsageError(str(error)) from error
