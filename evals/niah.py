"""RULER-style needle-in-a-haystack (NIAH, single needle) for a local Hugging Face model
directory, dense vs FlashPrefill V2 side by side through ``router.offline``.

Task (one sample per context length, needle depth and trial)
    A haystack of filler prose (generated here from fixed word lists by a seeded RNG: no
    downloads) holds one needle sentence, ``The special magic number for <key> is <value>.``,
    with ``<key>`` an adjective-noun pair and ``<value>`` a 7-digit number, inserted at a
    sentence boundary at the requested depth (0% = before the first filler sentence, 100% =
    after the last). The question comes at the end:

        A special magic number is hidden within the following text. Make sure to memorize it.
        I will quiz you about the number afterwards.

        <haystack with the needle>

        What is the special magic number for <key> mentioned in the provided text?

    as one user turn of the tokenizer's chat template when it has one (else plain text after
    BOS), followed by the answer prefix ``The special magic number for <key> mentioned in the
    provided text is`` (as RULER does; ``--no-answer-prefix`` drops it). The context length is
    counted in the model's tokens and holds the answer too, as in RULER: each prompt is as long
    as possible within ``length - max_new_tokens`` tokens (the exact count is in the JSON).
    The haystack of a (length, trial) is shared by every depth; key and value are drawn per
    sample.

Scoring: greedy decoding of ``--max-new-tokens`` tokens (stopping at the tokenizer's end of
turn / end of text); a sample is correct when the value appears in the decoded text as a whole
digit run (``(?<!\\d)1234567(?!\\d)``), RULER's string match made strict about neighbouring
digits.

Modes: ``dense`` (``alpha = 0``: every visible block, exact attention) and, for each
``--alphas`` value, ``sparse_a<alpha>`` (mean correction on) and ``sparse_a<alpha>_nocorr``
(off); block / sink / window as ``--block-size``/``--sink``/``--window`` (default: the paper's
128 / 256 / 512). Every mode runs the same prompts, whole-prompt prefill (no chunking), with
``dense_below = 0`` so that a sparse mode is sparse at every length. Prefill density (selected
over causal key-query pairs, all layers and heads of the prefill forwards) is recorded per
(length, mode) by wrapping ``kernels.ops.build_index_planned`` while the harness runs
(``--no-density`` turns it off).

    python -m evals.niah --model /path/to/Llama-3.1-8B-Instruct            # H200
    python -m evals.niah --model builtin:smollm2-135m --device cpu --threads 1 --lengths 2048 \
        --alphas 0.1 0.3 --correction on                                   # CPU, real model (8K context)
    python -m evals.niah --model builtin:tiny --device cpu --lengths 512   # plumbing only

The prompts and the scoring are the calibration's (``model_executor/calibration/needle.py``,
which ``python -m router calibrate`` runs on a ModelRunner directly).

``--model`` takes ``builtin:smollm2-135m`` (SmolLM2-135M-Instruct, converted once from its GGUF)
or the converted Hugging Face directory itself (what a host without the ``gguf`` package uses);
neither this module nor ``router.offline`` imports Ray.

Writes ``benchmarks/results/niah.json`` (``--out``) and prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.config import SparseConfig
from model_executor.calibration.needle import (  # noqa: F401 (the task: this module's API)
    ANSWER_PREFIX,
    DEPTHS,
    INSTRUCTION,
    NEEDLE,
    QUESTION,
    Haystack,
    Sample,
    build_sample,
    build_samples,
    encode_prompt,
    has_chat_template,
    is_correct,
    stop_token_ids,
)

LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
ALPHAS = (0.1,)
MAX_NEW_TOKENS = 32

# ---------------------------------------------------------------------------------------------
# Modes and density recording


@dataclass(frozen=True)
class Mode:
    name: str
    config: SparseConfig

    @property
    def alpha(self) -> float:
        return float(self.config.alpha)


def make_modes(base: SparseConfig, alphas: Sequence[float], correction: str = "both") -> list[Mode]:
    """``dense`` (alpha 0) then, per alpha, ``sparse_a<alpha>`` and/or ``..._nocorr``."""
    if correction not in ("on", "off", "both"):
        raise ValueError(f"correction: expected 'on', 'off' or 'both', got {correction!r}")
    modes = [Mode("dense", dataclasses.replace(base, alpha=0.0))]
    for a in alphas:
        if not 0.0 < a <= 1.0:
            raise ValueError(f"alphas: expected values in (0, 1], got {a}")
        if correction in ("on", "both"):
            modes.append(Mode(f"sparse_a{a:g}", dataclasses.replace(base, alpha=float(a), mean_correction=True)))
        if correction in ("off", "both"):
            modes.append(Mode(f"sparse_a{a:g}_nocorr",
                              dataclasses.replace(base, alpha=float(a), mean_correction=False)))
    return modes


@dataclass
class DensityLog:
    """Index calls seen while recording: ``(alpha, mean_correction, density)`` each."""

    calls: list[tuple[float, bool, float]] = field(default_factory=list)

    def take(self) -> list[tuple[float, bool, float]]:
        out, self.calls = self.calls, []
        return out


@contextlib.contextmanager
def record_index_calls(log: DensityLog, *, measure: bool = True):
    """While active, every ``kernels.ops.build_index_planned`` call (the model runner's index
    stage, one per layer per prefill forward) appends its plan's alpha, correction flag and
    index density (``evals.density.density``; 1.0 without counting for ``alpha = 0``, NaN with
    ``measure=False``) to ``log``."""
    from kernels import ops

    from .density import density

    original = ops.build_index_planned

    def wrapped(q, k_pages, v_pages, plan, **kw):  # backend, descales: passed through
        index = original(q, k_pages, v_pages, plan, **kw)
        if not measure:
            d = float("nan")
        elif plan.config.alpha == 0.0:
            d = 1.0  # alpha 0 keeps every visible block; counting them costs seconds at 128K
        else:
            d = float(density(index, plan))
        log.calls.append((float(plan.config.alpha), bool(plan.config.mean_correction), d))
        return index

    ops.build_index_planned = wrapped
    try:
        yield log
    finally:
        ops.build_index_planned = original


# ---------------------------------------------------------------------------------------------
# Running


def kv_bytes_per_token(loaded) -> int:
    param = next(loaded.model.parameters())
    return 2 * loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * param.element_size()


def run_niah(
    loaded,
    *,
    lengths: Sequence[int] = LENGTHS,
    depths: Sequence[float] = DEPTHS,
    trials: int = 1,
    modes: Sequence[Mode] | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
    seed: int = 0,
    chat: bool | None = None,
    answer_prefix: bool = True,
    dense_below: int = 0,
    backend: str = "auto",
    batch_tokens: int = 65536,
    kv_budget_gb: float = 40.0,
    measure_density: bool = True,
    generate_fn: Callable | None = None,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Run every sample through every mode; returns the JSON payload (without environment).

    ``generate_fn`` defaults to ``router.offline.generate`` (tests pass stubs with the
    same signature). Samples of one length go through ``generate_fn`` in groups whose KV cache
    fits ``kv_budget_gb``; forwards hold at most ``max(batch_tokens, length)`` tokens.
    """
    from model_executor.sampling import SamplingParams

    if generate_fn is None:
        from router.offline import generate as generate_fn
    if loaded.tokenizer is None:
        raise ValueError("model: the NIAH harness needs a tokenizer (the model directory has none)")
    if trials < 1:
        raise ValueError(f"trials: expected >= 1, got {trials}")
    modes = list(modes) if modes is not None else make_modes(SparseConfig(), ALPHAS)
    say = log or (lambda _msg: None)
    tok = loaded.tokenizer
    chat = has_chat_template(tok) if chat is None else chat
    t0 = time.perf_counter()
    max_pos = getattr(loaded.config, "max_position_embeddings", None)
    if max_pos is not None and max(lengths) > int(max_pos):
        raise ValueError(
            f"lengths: {max(lengths)} tokens exceed the model's max_position_embeddings ({max_pos})"
        )
    samples = build_samples(tok, lengths, depths, trials, seed, chat=chat, answer_prefix=answer_prefix,
                            reserve=max_new_tokens)
    build_s = time.perf_counter() - t0
    say(f"built {len(samples)} prompts in {build_s:.1f}s (chat template: {chat})")
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                            stop_token_ids=stop_token_ids(loaded))
    bpt = kv_bytes_per_token(loaded)
    outputs: dict[tuple[int, str], str] = {}  # (sample index, mode) -> text
    density_rows, timing = [], []
    dlog = DensityLog()
    recorder = record_index_calls(dlog, measure=measure_density)
    with recorder:
        for length in lengths:
            idx = [i for i, s in enumerate(samples) if s.length == length]
            per_call = max(1, int(kv_budget_gb * 2**30 // ((length + max_new_tokens) * bpt)))
            for mode in modes:
                t1 = time.perf_counter()
                for g0 in range(0, len(idx), per_call):
                    group = idx[g0 : g0 + per_call]
                    prompts = [list(samples[i].prompt_ids) for i in group]
                    res = generate_fn(
                        prompts, params, model=loaded, sparse_config=mode.config,
                        dense_below=dense_below, backend=backend,
                        max_batch_tokens=max(batch_tokens, max(len(p) for p in prompts)),
                    )
                    for i, r in zip(group, res):
                        outputs[(i, mode.name)] = tok.decode(r.output_token_ids)
                calls = dlog.take()
                seconds = time.perf_counter() - t1
                dens = [d for _, _, d in calls]
                density_rows.append({
                    "length": length, "mode": mode.name, "alpha": mode.alpha,
                    "mean_correction": mode.config.mean_correction, "index_calls": len(calls),
                    "alphas_seen": sorted({a for a, _, _ in calls}),
                    "density": (sum(dens) / len(dens)) if dens and measure_density else None,
                })
                timing.append({"length": length, "mode": mode.name, "seconds": seconds})
                correct = sum(is_correct(samples[i].value, outputs[(i, mode.name)]) for i in idx)
                say(f"L={length} {mode.name}: {correct}/{len(idx)} correct in {seconds:.1f}s")
    rows = []
    for length in lengths:
        for depth in depths:
            idx = [i for i, s in enumerate(samples) if s.length == length and s.depth == depth]
            for mode in modes:
                correct = sum(is_correct(samples[i].value, outputs[(i, mode.name)]) for i in idx)
                rows.append({
                    "length": length, "depth": depth, "mode": mode.name, "alpha": mode.alpha,
                    "mean_correction": mode.config.mean_correction, "trials": len(idx),
                    "correct": correct, "accuracy": correct / len(idx),
                    "mean_prompt_tokens": sum(samples[i].prompt_tokens for i in idx) / len(idx),
                })
    summary = []
    for length in lengths:
        for mode in modes:
            sel = [r for r in rows if r["length"] == length and r["mode"] == mode.name]
            n = sum(r["trials"] for r in sel)
            c = sum(r["correct"] for r in sel)
            dens = next(d["density"] for d in density_rows if d["length"] == length and d["mode"] == mode.name)
            summary.append({"length": length, "mode": mode.name, "alpha": mode.alpha,
                            "mean_correction": mode.config.mean_correction, "samples": n,
                            "accuracy": c / n, "density": dens})
    return {
        "benchmark": "RULER-style needle in a haystack (evals/niah.py)",
        "model": {"name": loaded.name, "num_layers": loaded.num_layers,
                  "num_qo_heads": int(loaded.config.num_attention_heads),
                  "num_kv_heads": loaded.num_kv_heads, "head_dim": loaded.head_dim,
                  "dtype": str(next(loaded.model.parameters()).dtype).replace("torch.", ""),
                  "device": str(next(loaded.model.parameters()).device)},
        "settings": {"lengths": list(lengths), "depths": list(depths), "trials": trials,
                     "max_new_tokens": max_new_tokens, "seed": seed, "chat_template": chat,
                     "answer_prefix": answer_prefix, "dense_below": dense_below, "backend": backend,
                     "stop_token_ids": list(params.stop_token_ids), "kv_budget_gb": kv_budget_gb,
                     "batch_tokens": batch_tokens, "scoring": "value as a whole digit run in the output"},
        "modes": [{"name": m.name, "config": dataclasses.asdict(m.config)} for m in modes],
        "rows": rows,
        "summary": summary,
        "density": density_rows,
        "timing": timing,
        "prompt_build_seconds": build_s,
        "samples": [
            {"length": s.length, "depth": s.depth, "trial": s.trial, "key": s.key, "value": s.value,
             "prompt_tokens": s.prompt_tokens, "needle_depth": s.needle_depth,
             "outputs": {m.name: outputs[(i, m.name)] for m in modes},
             "correct": {m.name: is_correct(s.value, outputs[(i, m.name)]) for m in modes}}
            for i, s in enumerate(samples)
        ],
    }


def print_table(payload: dict, file=None) -> None:
    file = file or sys.stdout
    modes = [m["name"] for m in payload["modes"]]
    width = max(8, *(len(m) for m in modes))
    head = f"{'length':>7} {'depth':>6} | " + " ".join(f"{m:>{width}}" for m in modes)
    print(head, file=file)
    for length in payload["settings"]["lengths"]:
        for depth in payload["settings"]["depths"]:
            cells = {r["mode"]: r for r in payload["rows"] if r["length"] == length and r["depth"] == depth}
            print(f"{length:>7} {depth:>6.2f} | "
                  + " ".join(f"{cells[m]['accuracy']:>{width}.2f}" for m in modes), file=file)
        cells = {r["mode"]: r for r in payload["summary"] if r["length"] == length}
        print(f"{length:>7} {'all':>6} | " + " ".join(f"{cells[m]['accuracy']:>{width}.2f}" for m in modes), file=file)
        dens = " ".join(f"{cells[m]['density']:>{width}.3f}" if cells[m]["density"] is not None
                        else f"{'-':>{width}}" for m in modes)
        print(f"{length:>7} {'dens.':>6} | {dens}", file=file)


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m evals.niah", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face model directory, builtin:smollm2-135m or builtin:tiny")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="context lengths in tokens")
    p.add_argument("--depths", type=float, nargs="+", default=[100 * d for d in DEPTHS],
                   help="needle depths in percent (0 25 50 75 100)")
    p.add_argument("--trials", type=int, default=1, help="samples per (length, depth)")
    p.add_argument("--alphas", type=float, nargs="+", default=list(ALPHAS), help="sparse modes' alpha")
    p.add_argument("--correction", choices=("on", "off", "both"), default="both",
                   help="sparse modes with mean correction on, off, or both")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--sink", type=int, default=256, help="sink tokens")
    p.add_argument("--window", type=int, default=512, help="local window tokens")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--no-chat-template", action="store_true", help="plain prompt even if the tokenizer has a template")
    p.add_argument("--no-answer-prefix", action="store_true")
    p.add_argument("--dense-below", type=int, default=0,
                   help="prefill batches shorter than this use dense attention in every mode (0)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="auto: the checkpoint's dtype (builtin:tiny: fp32)")
    p.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto")
    p.add_argument("--batch-tokens", type=int, default=65536, help="max tokens per prefill forward "
                   "(a prompt longer than this still runs whole)")
    p.add_argument("--kv-budget-gb", type=float, default=40.0, help="KV cache per generate call")
    p.add_argument("--no-density", action="store_true", help="do not measure prefill density")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/niah.json)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    from evals.report import RESULTS_DIR, environment
    from model_executor.loading import load_model

    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads: expected >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    for d in args.depths:
        if not 0.0 <= d <= 100.0:
            raise SystemExit(f"--depths: expected percentages in [0, 100], got {d}")
    base = SparseConfig(block_size=args.block_size, sink_tokens=args.sink, window_tokens=args.window)
    modes = make_modes(base, args.alphas, args.correction)
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=dtype, device=device, seed=args.seed)
    print(f"loaded {loaded.name} on {device} in {time.perf_counter() - t0:.1f}s", flush=True)
    payload = run_niah(
        loaded, lengths=args.lengths, depths=[d / 100 for d in args.depths], trials=args.trials,
        modes=modes, max_new_tokens=args.max_new_tokens, seed=args.seed,
        chat=False if args.no_chat_template else None, answer_prefix=not args.no_answer_prefix,
        dense_below=args.dense_below, backend=args.backend, batch_tokens=args.batch_tokens,
        kv_budget_gb=args.kv_budget_gb, measure_density=not args.no_density,
        log=lambda m: print(m, flush=True),
    )
    payload = {"benchmark": payload.pop("benchmark"), "environment": environment(), **payload}
    path = Path(args.out) if args.out else RESULTS_DIR / "niah.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")
    print_table(payload)
    return payload


if __name__ == "__main__":
    main()
