"""``python -m router calibrate``: the options (added to router's parser) and the command.

    python -m router calibrate --model builtin:smollm2-135m --budget-kl 0.02 --out profile.json
    python -m router calibrate --table profile.json            # the Pareto table as Markdown

Exit status: 0 the budget is met (profile written), 1 it is not (the best setting is written,
``budget.met = false``, the reasons printed), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .grid import GRIDS, SCHEDULES, Axes

CPU_LENGTHS = (2048,)
CUDA_LENGTHS = (2048, 4096, 8192, 16384, 32768)
PROG = "python -m router calibrate"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2-135m",
                   help="builtin:smollm2-135m (default), builtin:tiny or a Hugging Face model directory")
    p.add_argument("--model-name", default=None, help="the name the profile records (default --model; e.g. "
                   "builtin:smollm2-135m when --model is its converted directory)")
    p.add_argument("--budget-kl", type=float, default=None,
                   help="mean KL (nats) against dense over the last 256 positions, at most (required)")
    p.add_argument("--budget-kl-last", type=float, default=0.01,
                   help="mean KL over the last 8 positions of each prompt, at most (0.01)")
    p.add_argument("--needle-slack", type=int, default=1, help="needle retrieval at least dense's minus this (1)")
    p.add_argument("--lastword-slack", type=int, default=1, help="last-word items at least dense's minus this (1)")
    p.add_argument("--out", default=None, metavar="FILE", help="the profile to write (required)")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help=f"prompt lengths (default {list(CPU_LENGTHS)} on CPU, {list(CUDA_LENGTHS)} on CUDA; "
                        "beyond the trained context with --rope-scaling)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="auto: the checkpoint's (SmolLM2 as converted: fp32)")
    p.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto",
                   help="kernels (auto: Triton on CUDA, the reference on CPU)")
    p.add_argument("--grid", choices=tuple(GRIDS), default="full", help="quick: CI-sized; full: every axis (default)")
    p.add_argument("--alphas", type=float, nargs="+", default=None, help="override the grid's alphas")
    p.add_argument("--last-dense-tiles", type=int, nargs="+", default=None, help="override the grid's dense last tiles")
    p.add_argument("--energy-rules", nargs="+", default=None, help="override the grid's energy rules")
    p.add_argument("--dense-layers", type=int, nargs="+", default=None, help="override the grid's dense first layers")
    p.add_argument("--schedules", nargs="+", default=None, help=f"override the grid's per-layer schedules {SCHEDULES}")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--sink", type=int, default=256, help="sink tokens")
    p.add_argument("--window", type=int, default=512, help="local window tokens")
    p.add_argument("--no-mean-correction", action="store_true")
    p.add_argument("--prompts", type=int, default=32, help="text windows per length (32)")
    p.add_argument("--prompts-beyond-trained", type=int, default=None,
                   help="text windows per length beyond the trained context (default --prompts)")
    p.add_argument("--needles", type=int, default=20, help="needle prompts per length (20; 0: none)")
    p.add_argument("--needle-new-tokens", type=int, default=16, help="greedy answer tokens (16)")
    p.add_argument("--lastword-items", type=int, default=300, help="last-word items (300; 0: none)")
    p.add_argument("--lastword-chars", type=int, default=6000, help="last-word context characters (6000, the task's)")
    p.add_argument("--sensitivity-length", type=int, default=None,
                   help="length of the per-layer sensitivity (default the longest within the trained context)")
    p.add_argument("--sensitivity-prompts", type=int, default=8)
    p.add_argument("--text", default="pydoc-topics", help="'pydoc-topics' or a UTF-8 text file")
    p.add_argument("--rope-scaling", choices=("yarn", "linear", "none"), default="yarn",
                   help="RoPE beyond the trained context (factor length / trained)")
    p.add_argument("--dense-below", type=int, default=None,
                   help="record this dense_below and check the budget only at lengths >= it (default: none, all)")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="tokens per forward (default 32768 on CUDA, 4096 on CPU; a longer prompt runs alone)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop measuring after this long (not met)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", default=None, metavar="PROFILE", help="print PROFILE's Pareto table (Markdown) and exit")
    p.add_argument("--pareto-only", action="store_true", help="with --table: the Pareto front and the chosen row")


def settings_from_args(args: argparse.Namespace):
    """The :class:`~.calibrate.Settings` of parsed arguments (ValueError naming the flag)."""
    import torch

    from kernels.config import SparseConfig

    from .settings import Budget, Settings

    if args.budget_kl is None:
        raise ValueError("--budget-kl: required (the mean KL over the last 256 positions, in nats)")
    if args.out is None:
        raise ValueError("--out: required (the profile file to write)")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: expected an int >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda asked for, but torch sees no CUDA device")
    preset = GRIDS[args.grid]
    try:
        axes = Axes(alphas=tuple(args.alphas or preset.alphas),
                    last_dense_tiles=tuple(args.last_dense_tiles if args.last_dense_tiles is not None
                                           else preset.last_dense_tiles),
                    energy_rules=tuple(args.energy_rules or preset.energy_rules),
                    dense_layers=tuple(args.dense_layers if args.dense_layers is not None else preset.dense_layers),
                    schedules=tuple(args.schedules or preset.schedules))
    except ValueError as exc:  # name the flag: alphas -> --alphas
        name, _, rest = str(exc).partition(":")
        raise ValueError(f"--{name.replace('_', '-')}:{rest}") from None
    try:
        base = SparseConfig(block_size=args.block_size, sink_tokens=args.sink, window_tokens=args.window,
                            mean_correction=not args.no_mean_correction)
    except ValueError as exc:
        flag = {"block_size": "--block-size", "sink_tokens": "--sink", "window_tokens": "--window"}
        name, _, rest = str(exc).partition(":")
        raise ValueError(f"{flag.get(name, name)}:{rest}") from None
    dtype = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    lengths = tuple(args.lengths or (CUDA_LENGTHS if device == "cuda" else CPU_LENGTHS))
    return Settings(
        model=args.model, model_name=args.model_name, lengths=lengths,
        budget=Budget(kl=args.budget_kl, kl_last=args.budget_kl_last, needle_slack=args.needle_slack,
                      lastword_slack=args.lastword_slack),
        grid=tuple(axes.points()), base=base, prompts=args.prompts,
        prompts_beyond_trained=args.prompts_beyond_trained, needles=args.needles,
        needle_new_tokens=args.needle_new_tokens, lastword_items=args.lastword_items,
        lastword_chars=args.lastword_chars, sensitivity_length=args.sensitivity_length,
        sensitivity_prompts=args.sensitivity_prompts, text=args.text, rope_scaling=args.rope_scaling,
        dense_below=args.dense_below, device=device, dtype=dtype, backend=args.backend,
        batch_tokens=args.batch_tokens or (32768 if device == "cuda" else 4096), max_seconds=args.max_seconds,
        seed=args.seed,
    )


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """The command (module docstring); ``argv``: the command line after ``calibrate``, recorded
    in the profile's provenance."""
    from ..sparse_profile import SparseProfile
    from . import table
    from .calibrate import OutOfTime, calibrate

    def fail(msg: str) -> int:
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2

    if args.table is not None:
        try:
            profile = SparseProfile.load(args.table)
        except ValueError as exc:
            return fail(f"--table: {exc}")
        sys.stdout.write(table.markdown(profile, pareto_only=args.pareto_only))
        return 0
    try:
        settings = settings_from_args(args)
        result = calibrate(settings, argv=argv, log=lambda m: print(m, flush=True))
    except ValueError as exc:
        return fail(str(exc))
    except OutOfTime as exc:
        print(f"{PROG}: {exc}; no profile written", file=sys.stderr)
        return 1
    path = result.profile.save(args.out)
    print(f"wrote {path}: {result.chosen}, expected density {result.profile.expected_density}")
    if not result.met:
        print(f"{PROG}: the budget is NOT met; the best setting was written (budget.met = false): "
              + "; ".join(result.failures), file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m router calibrate ARGS`` (``argv``: ARGS)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=PROG, description="Calibrate sparse prefill to a quality budget: measure "
                                     "a grid of sparse settings against dense and write the sparsest that meets it.")
    add_arguments(parser)
    return run(parser.parse_args(argv), argv)
