"""How much FlashPrefill V2 sparse prefill changes a real model's next-token distributions:
dense vs sparse prefill logits, position by position, on real text.

Text. ``--text pydoc-topics`` (default): the Python language reference topics that CPython
ships in ``pydoc_data.topics`` (English technical prose with code), topics in sorted key order,
each stripped, joined by a blank line; always present offline, but its wording follows the
Python version (the JSON records the version, the character count and the SHA-256, and
``--save-text FILE`` writes the exact text so that another machine can read it back with
``--text FILE``). ``--text FILE``: any UTF-8 file. The text is tokenized once, without BOS (as
SmolLM2's tokenizer does), and a prompt of length ``L`` is the token window
``[s * L, (s + 1) * L)`` for sample ``s`` (``--samples``; sample 0 starts the text).

Prefill. Through our own ``model_executor.runner.ModelRunner`` over a paged KV pool,
whole-prompt (one forward, no chunking), ``dense_below = 0`` so a sparse mode is sparse at
every length, keeping the logits of every position (``prefill_keeping``, the path of prompt
logprobs). Modes, each over the same windows:

- ``dense``: ``alpha = 0`` per forward, which the runner runs as exact dense attention;
- ``floor``: the sparse kernels themselves at ``alpha = 0`` (every visible block, no
  correction term): the numerical floor of the sparse path, which should be ~0;
- ``a<alpha>`` (mean correction on) and ``a<alpha>_nocorr`` (``SparseConfig.mean_correction =
  False``) for each ``--alphas`` value; block / sink / window ``--block-size`` / ``--sink`` /
  ``--window`` (default the paper's 128 / 256 / 512).

Metrics, against ``dense``, over the *scored positions* ``t`` in ``[--score-from, L - 2]``
(default 1024: the first 768 positions see only sink and window blocks, so sparsity cannot act
there; position ``t``'s logits predict token ``t + 1``): mean and max ``KL(dense || mode)`` of
the next-token distribution (nats, float64 log-softmax of the float32 logits), top-1 agreement
(argmax equal), perplexity of the actual next tokens under dense and under the mode, and the
block density the forward ran at (``ModelRunner.index_tile_counts``: selected over causal
(128-query, 64-key) tile pairs, all layers and KV heads; 1 for ``dense``).

Lengths beyond the model's trained context (``max_position_embeddings``, 8192 for
SmolLM2-135M) run with RoPE scaling (``--rope-scaling yarn`` (default) or ``linear``, factor
``L / trained``; ``model_executor.loading.rope_scaling_overrides``): dense and sparse then share
the scaled model, and the table marks those rows as beyond the trained context.

    python -m evals.real_fidelity --device cpu --threads 1     # CPU: ten 2K forwards (43 min on a loaded 2-core box)
    python -m evals.real_fidelity --model DIR --device cuda --lengths 8192 16384 32768

``--model``: ``builtin:smollm2-135m`` (default) or an already converted Hugging Face directory
(``model_executor.gguf.gguf_dir`` writes one; the GPU host needs no ``gguf`` package then).
The text, the windows and the metrics are the calibration's (``model_executor/calibration``:
``python -m router calibrate`` measures the same way). Nothing here imports Ray or the service. Writes ``benchmarks/results/real_fidelity_<device>.json``
(``--out``) and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.config import SparseConfig
from model_executor.calibration.metrics import Comparison, compare_logits, summarize  # noqa: F401 (this module's API)
from model_executor.calibration.text import PYDOC_TOPICS as DEFAULT_TEXT
from model_executor.calibration.text import ROPE_SCALINGS, Text, load_text, rope_for, token_windows  # noqa: F401

DEFAULT_MODEL = "builtin:smollm2-135m"
LENGTHS = (2048, 4096, 8192, 16384, 32768)
CPU_LENGTHS = (2048,)
ALPHAS = (0.05, 0.1, 0.2, 0.3)
SCORE_FROM = 1024


# ---------------------------------------------------------------------------------------------
# Modes and prefill


@dataclass(frozen=True)
class Mode:
    """``via_index``: run through the sparse kernels with this config as the runner's own
    (``alpha = 0`` included); otherwise as a per-forward config (``alpha = 0``: dense path)."""

    name: str
    config: SparseConfig
    via_index: bool = False


def make_modes(base: SparseConfig, alphas: Sequence[float], correction: str = "both", floor: bool = True) -> list[Mode]:
    """``dense``, ``floor`` (optional), then ``a<alpha>`` / ``a<alpha>_nocorr`` per alpha."""
    if correction not in ("on", "off", "both"):
        raise ValueError(f"correction: expected 'on', 'off' or 'both', got {correction!r}")
    modes = [Mode("dense", dataclasses.replace(base, alpha=0.0))]
    if floor:
        modes.append(Mode("floor", dataclasses.replace(base, alpha=0.0, mean_correction=False), via_index=True))
    for a in alphas:
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 < a <= 1.0:
            raise ValueError(f"alphas: expected values in (0, 1], got {a!r}")
        if correction in ("on", "both"):
            modes.append(Mode(f"a{a:g}", dataclasses.replace(base, alpha=float(a), mean_correction=True)))
        if correction in ("off", "both"):
            modes.append(Mode(f"a{a:g}_nocorr", dataclasses.replace(base, alpha=float(a), mean_correction=False)))
    return modes


def prefill_logits(runner, ids: Sequence[int], mode: Mode, rid: str = "fidelity") -> tuple[torch.Tensor, tuple[int, int] | None]:
    """Float32 logits of every position of one whole-prompt prefill ``[len(ids), V]`` and the
    forward's ``(selected, causal)`` tile counts (``None``: it ran dense). Releases its pages."""
    from model_executor.runner import PrefillItem

    saved = runner.sparse_config
    runner.pool.reserve(rid, len(ids))
    try:
        if mode.via_index:
            runner.sparse_config = mode.config
        _, kept = runner.prefill_keeping([PrefillItem(rid, ids)], keep_all=[True],
                                         sparse_config=None if mode.via_index else mode.config)
        counts = runner.index_tile_counts().get(rid)
    finally:
        runner.sparse_config = saved
        runner.pool.release(rid)
    return kept[0], counts


def run_length(loaded, windows: Sequence[Sequence[int]], modes: Sequence[Mode], *, score_from: int,
               base: SparseConfig, backend: str = "auto", page_size: int = 64,
               log: Callable[[str], None] = lambda _m: None) -> list[dict]:
    """Every mode over every window of one length; one row per mode (aggregated over windows)."""
    from model_executor.loading import make_pool
    from model_executor.runner import ModelRunner

    if modes[0].name != "dense":
        raise ValueError(f"modes: expected 'dense' first (the reference), got {modes[0].name!r}")
    length = len(windows[0])
    if not 0 <= score_from <= length - 2:
        raise ValueError(f"score_from: expected a position in [0, {length - 2}] for length {length}, got {score_from}")
    pool = make_pool(loaded, num_pages=-(-length // page_size) + 1, page_size=page_size)
    runner = ModelRunner(loaded.model, pool, base, dense_below=0, backend=backend)
    dense, targets = [], []
    parts: dict[str, list[Comparison]] = {m.name: [] for m in modes}
    tiles: dict[str, list[int]] = {m.name: [0, 0] for m in modes}
    seconds: dict[str, float] = {m.name: 0.0 for m in modes}
    dense_counted = True
    for w, ids in enumerate(windows):
        tgt = torch.tensor(ids[score_from + 1:], dtype=torch.int64)
        for mode in modes:
            t0 = time.perf_counter()
            logits, counts = prefill_logits(runner, ids, mode)
            rows = logits[score_from:length - 1]
            if mode.name == "dense":
                ref = rows.clone()
                del logits, rows
                parts["dense"].append(compare_logits(ref, ref, tgt))
                dense_counted = dense_counted and counts is None
            else:
                parts[mode.name].append(compare_logits(ref, rows, tgt))
                del logits, rows
            if counts is not None:
                tiles[mode.name][0] += counts[0]
                tiles[mode.name][1] += counts[1]
            seconds[mode.name] += time.perf_counter() - t0
            log(f"L={length} window {w} {mode.name}: KL mean {float(parts[mode.name][-1].kl.mean()):.3e} "
                f"({seconds[mode.name]:.1f}s)")
        del ref
    out = []
    for mode in modes:
        sel, causal = tiles[mode.name]
        density = 1.0 if mode.name == "dense" and dense_counted else (sel / causal if causal else None)
        out.append({"length": length, "mode": mode.name, "alpha": float(mode.config.alpha),
                    "mean_correction": bool(mode.config.mean_correction), "via_index": mode.via_index,
                    "windows": len(windows), "density": density, "selected_tiles": sel, "causal_tiles": causal,
                    **summarize(parts[mode.name]), "seconds": seconds[mode.name]})
    return out


def run_fidelity(model: str, *, lengths: Sequence[int], modes: Sequence[Mode], base: SparseConfig,
                 text: Text, samples: int = 1, score_from: int = SCORE_FROM, rope_scaling: str = "yarn",
                 device: str = "cpu", dtype: torch.dtype | None = None, backend: str = "auto",
                 seed: int = 0, log: Callable[[str], None] = lambda _m: None) -> dict:
    """Load ``model`` (again for each RoPE scaling a length needs) and run every length; the
    JSON payload (without environment)."""
    from model_executor.loading import load_model

    if not lengths:
        raise ValueError("lengths: expected at least one length")
    t0 = time.perf_counter()
    loaded = load_model(model, dtype=dtype, device=device, seed=seed)
    log(f"loaded {model} on {device} in {time.perf_counter() - t0:.1f}s")
    if loaded.tokenizer is None:
        raise ValueError(f"model: {model} has no tokenizer; the harness tokenizes text")
    trained = int(loaded.config.max_position_embeddings)
    ids = loaded.tokenizer.encode(text.text, add_bos=False)
    rows, by_rope = [], {None: loaded}
    for length in lengths:
        windows = token_windows(ids, length, samples)  # ValueError before any forward
        rope = rope_for(length, trained, rope_scaling)
        key = None if rope is None else json.dumps(rope, sort_keys=True)
        if key not in by_rope:
            by_rope.clear()  # one model in memory at a time
            by_rope[key] = load_model(model, dtype=dtype, device=device, seed=seed, rope_scaling=rope)
            log(f"reloaded {model} with RoPE {rope}")
        for r in run_length(by_rope[key], windows, modes, score_from=score_from, base=base, backend=backend, log=log):
            rows.append({**r, "beyond_trained_context": length > trained, "rope_scaling": rope})
    param = next(loaded.model.parameters())
    cfg = loaded.config
    return {
        "benchmark": "real-model logits fidelity, dense vs FlashPrefill V2 prefill (evals/real_fidelity.py)",
        "model": {"name": model, "num_layers": loaded.num_layers, "num_qo_heads": int(cfg.num_attention_heads),
                  "num_kv_heads": loaded.num_kv_heads, "head_dim": loaded.head_dim,
                  "vocab_size": int(cfg.vocab_size), "trained_context": trained,
                  "dtype": str(param.dtype).replace("torch.", ""), "device": str(param.device)},
        "text": {"name": text.name, "chars": len(text.text), "sha256": text.sha256, "tokens": len(ids),
                 "python": sys.version.split()[0]},
        "settings": {"lengths": list(lengths), "samples": samples, "score_from": score_from,
                     "scored": f"positions t in [{score_from}, L - 2], predicting token t + 1",
                     "rope_scaling": rope_scaling, "dense_below": 0, "prefill": "whole prompt, one forward",
                     "backend": backend, "sparse": dataclasses.asdict(base), "seed": seed},
        "modes": [{"name": m.name, "via_index": m.via_index, "config": dataclasses.asdict(m.config)} for m in modes],
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------
# Output


def markdown_table(payload: dict) -> str:
    """The rows as a markdown table (one line per length and mode)."""
    lines = ["| length | RoPE | mode | alpha | correction | density | KL mean | KL max | top-1 agree | ppl dense | ppl mode |",
             "|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in payload["rows"]:
        rope = "trained" if r["rope_scaling"] is None else f"{r['rope_scaling']['rope_type']} x{r['rope_scaling']['factor']:g}"
        if r["beyond_trained_context"]:
            rope += " (beyond the trained context)"
        corr = "-" if r["mode"] in ("dense", "floor") else ("on" if r["mean_correction"] else "off")
        dens = "-" if r["density"] is None else f"{r['density']:.3f}"
        lines.append(f"| {r['length']} | {rope} | {r['mode']} | {r['alpha']:g} | {corr} | {dens} | "
                     f"{r['kl_mean']:.2e} | {r['kl_max']:.2e} | {r['top1_agreement']:.4f} | "
                     f"{r['ppl_dense']:.3f} | {r['ppl']:.3f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m evals.real_fidelity", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="builtin:smollm2-135m or a Hugging Face model directory")
    p.add_argument("--text", default=DEFAULT_TEXT, help=f"{DEFAULT_TEXT!r} or a UTF-8 text file")
    p.add_argument("--save-text", default=None, help="write the text used to this file")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help=f"prompt lengths in tokens (default: {list(CPU_LENGTHS)} on CPU, {list(LENGTHS)} on CUDA)")
    p.add_argument("--samples", type=int, default=1, help="token windows per length")
    p.add_argument("--alphas", type=float, nargs="+", default=list(ALPHAS))
    p.add_argument("--correction", choices=("on", "off", "both"), default="both")
    p.add_argument("--no-floor", action="store_true", help="skip the sparse-kernels-at-alpha-0 mode")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--sink", type=int, default=256, help="sink tokens")
    p.add_argument("--window", type=int, default=512, help="local window tokens")
    p.add_argument("--score-from", type=int, default=SCORE_FROM, help="first scored position")
    p.add_argument("--rope-scaling", choices=ROPE_SCALINGS, default="yarn",
                   help="RoPE for lengths beyond the trained context (factor length / trained)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="auto: the checkpoint's (SmolLM2 as converted: fp32)")
    p.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/real_fidelity_<device>.json)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    from evals.report import RESULTS_DIR, environment

    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads: expected >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    lengths = args.lengths or list(CPU_LENGTHS if device == "cpu" else LENGTHS)
    try:
        base = SparseConfig(block_size=args.block_size, sink_tokens=args.sink, window_tokens=args.window)
        modes = make_modes(base, args.alphas, args.correction, floor=not args.no_floor)
        text = load_text(args.text)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.save_text:
        Path(args.save_text).write_text(text.text, encoding="utf-8")
    payload = run_fidelity(args.model, lengths=lengths, modes=modes, base=base, text=text, samples=args.samples,
                           score_from=args.score_from, rope_scaling=args.rope_scaling, device=device, dtype=dtype,
                           backend=args.backend, seed=args.seed, log=lambda m: print(m, flush=True))
    payload = {"benchmark": payload.pop("benchmark"), "environment": {**environment(), "threads": torch.get_num_threads()},
               **payload}
    path = Path(args.out) if args.out else RESULTS_DIR / f"real_fidelity_{device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}\n")
    print(f"text: {payload['text']['name']}, {payload['text']['tokens']} tokens, sha256 {payload['text']['sha256'][:16]}")
    print(markdown_table(payload))
    return payload


if __name__ == "__main__":
    main()
