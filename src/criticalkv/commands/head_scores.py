"""``criticalkv head-scores``: compute a model's head importance scores (HeadKV) and save them."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from criticalkv.commands.common import UsageError, add_model_arguments, list_parts
from criticalkv.commands.inputs import output_folder

NAME = "head-scores"
HELP = "compute per-head retrieval(-reasoning) importance scores for HeadKV budgets"


def _lengths(text: str) -> tuple[int, ...]:
    parts = list_parts(text, "1024,2048")
    try:
        return tuple(int(part) for part in parts)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"lengths must be token counts such as 1024,2048: {err}") from err


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write (it is also cached for the model)")
    p.add_argument("--lengths", type=_lengths, default=(1024, 2048), help="context lengths (default 1024,2048)")
    p.add_argument("--depths", type=int, default=10, help="needle depths per length, evenly spaced (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the needle samples")
    p.add_argument(
        "--min-accuracy", type=float, default=1.0, help="share of the answer a sample must get right to count (1.0)"
    )
    p.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    p.add_argument("--no-cache", action="store_true", help="write only --out, not the per-model cache file")


def run(args: argparse.Namespace) -> int:
    from criticalkv.analysis.retrieval_heads import ScoringParameters, compute_head_scores
    from criticalkv.headscores.lookup import cache_path, model_name
    from criticalkv.models import load_model

    if args.out.exists() and args.out.is_dir():
        raise UsageError(f"--out {args.out} is a folder; give a file name such as {args.out / 'scores.json'}")
    output_folder(args.out.parent, f"--out {args.out}: its folder")
    params = ScoringParameters(
        lengths=args.lengths, depths=args.depths, seed=args.seed, min_accuracy=args.min_accuracy, chat=not args.no_chat
    )
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    if not getattr(tokenizer, "is_fast", False):  # the scoring raises TypeError: here it is the user's model
        raise UsageError("head scoring needs a fast tokenizer (it locates the needle by character offsets)")
    started = time.perf_counter()
    scores = compute_head_scores(model, tokenizer, params, model_name=model_name(model.config))
    written = [scores.save(args.out)]
    if not args.no_cache:
        written.append(scores.save(cache_path(model.config)))
    share = scores.matrix()
    share = share / share.sum()
    order = share.flatten().argsort(descending=True)[:5].tolist()
    heads = share.shape[1]
    print(
        f"{scores.model}: {scores.samples['used']} of {scores.samples['total']} samples used, "
        f"{time.perf_counter() - started:.0f} s"
    )
    top = [f"({i // heads}, {i % heads}: {float(share.flatten()[i]):.3f})" for i in order]
    print("top KV heads (layer, head: share of the total): " + ", ".join(top))
    for path in written:
        print(f"wrote {path}")
    return 0
