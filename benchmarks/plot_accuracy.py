"""PNG plots (and Markdown tables for ACCURACY.md) from the accuracy benchmarks' JSON files.

Inputs (each optional; a missing file is skipped with a note):
- ``fidelity.json`` (benchmarks/bench_fidelity.py): error, retained mass and density against
  length and alpha, mean correction on and off;
- ``retrieval.json`` (benchmarks/bench_retrieval.py): hand-built needle model accuracy against
  length, per needle size, dense / sparse / no correction;
- ``niah.json`` (evals/niah.py): NIAH accuracy against length per mode, and per depth.

Outputs ``<out-dir>/{fidelity_error_vs_length,fidelity_vs_alpha,retrieval_accuracy,
niah_accuracy}<suffix>.png`` with matplotlib's Agg backend (no display needed).

    PYTHONPATH=$PWD python benchmarks/plot_accuracy.py                      # GPU results -> docs/img
    PYTHONPATH=$PWD python benchmarks/plot_accuracy.py --fidelity benchmarks/results/fidelity_cpu.json \\
        --suffix _cpu --markdown                                             # + tables on stdout
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT_DIR = ROOT / "docs" / "img"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load(path: Path | None) -> dict | None:
    if path is None or not path.exists():
        return None
    return json.loads(path.read_text())


def _klabel(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _length_axis(ax, lengths) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([_klabel(n) for n in lengths])
    ax.minorticks_off()


def _title_env(payload: dict) -> str:
    env = payload.get("environment") or {}
    where = env.get("gpu") or f"CPU ({payload.get('device', 'cpu')})"
    return f"{where}, commit {str(env.get('git_commit') or '?')[:8]}"


# ---------------------------------------------------------------------------------------------
# Fidelity


def plot_fidelity(fid: dict, out_dir: Path, suffix: str) -> list[Path]:
    plt = _plt()
    rows = [r for r in fid["rows"] if r["dtype"] == "bf16"]
    families = [f for f in fid["families"] if any(r["family"] == f for r in rows)]
    alphas = sorted({r["alpha"] for r in rows})
    lengths = sorted({r["seqlen"] for r in rows})
    colors = plt.cm.viridis([i / max(1, len(alphas) - 1) for i in range(len(alphas))])
    paths = []

    # 1. relative L2 error against length, one line per alpha, correction on (solid) / off (dashed)
    fig, axes = plt.subplots(1, len(families), figsize=(6 * len(families), 4.5), squeeze=False)
    for ax, fam in zip(axes[0], families):
        for a, c in zip(alphas, colors):
            sel = sorted((r for r in rows if r["family"] == fam and r["alpha"] == a), key=lambda r: r["seqlen"])
            xs = [r["seqlen"] for r in sel]
            ax.plot(xs, [r["rel_l2_corrected"] for r in sel], "-o", color=c, label=f"alpha {a:g}, correction")
            ax.plot(xs, [r["rel_l2_uncorrected"] for r in sel], "--x", color=c, label=f"alpha {a:g}, none")
        sel = sorted((r for r in rows if r["family"] == fam and r["alpha"] == alphas[0]), key=lambda r: r["seqlen"])
        ax.plot([r["seqlen"] for r in sel], [r["rel_l2_dtype_floor"] for r in sel], ":", color="grey",
                label="bf16 rounding of the exact output")
        ax.set_yscale("log")
        _length_axis(ax, lengths)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("relative L2 error vs exact dense")
        ax.set_title(f"{fam} inputs")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"FlashPrefill V2 output error, bf16 ({_title_env(fid)})", fontsize=10)
    fig.tight_layout()
    p = out_dir / f"fidelity_error_vs_length{suffix}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    # 2. against alpha (graded family when present): density, error, retained mass
    fam = "graded" if "graded" in families else families[0]
    lcolors = plt.cm.plasma([i / max(1, len(lengths)) for i in range(len(lengths))])
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for n, c in zip(lengths, lcolors):
        sel = sorted((r for r in rows if r["family"] == fam and r["seqlen"] == n), key=lambda r: r["alpha"])
        xs = [r["alpha"] for r in sel]
        axes[0].plot(xs, [r["density"] for r in sel], "-o", color=c, label=_klabel(n))
        axes[1].plot(xs, [r["rel_l2_corrected"] for r in sel], "-o", color=c, label=f"{_klabel(n)} correction")
        axes[1].plot(xs, [r["rel_l2_uncorrected"] for r in sel], "--x", color=c, label=f"{_klabel(n)} none")
        axes[2].plot(xs, [1 - r["retained_mass"] for r in sel], "-o", color=c, label=f"{_klabel(n)} mean")
        axes[2].plot(xs, [1 - r["retained_mass_min"] for r in sel], ":", color=c, label=f"{_klabel(n)} worst")
    for ax, ylabel in zip(axes, ("density (selected / causal pairs)", "relative L2 error",
                                 "pruned softmax mass (1 - retained)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(alphas)
        ax.set_xticklabels([f"{a:g}" for a in alphas])
        ax.minorticks_off()
        ax.set_xlabel("alpha")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=6, ncol=2)
    axes[2].legend(fontsize=6, ncol=2)
    fig.suptitle(f"alpha sweep on {fam} inputs, bf16 ({_title_env(fid)})", fontsize=10)
    fig.tight_layout()
    p = out_dir / f"fidelity_vs_alpha{suffix}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


# ---------------------------------------------------------------------------------------------
# Hand-built retrieval model


def plot_retrieval(ret: dict, out_dir: Path, suffix: str) -> list[Path]:
    plt = _plt()
    rows = ret["rows"]
    repeats = sorted({r["needle_repeats"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    styles = {"dense": ("k", "-o"), "sparse": ("tab:blue", "-s"), "sparse_nocorr": ("tab:red", "--x")}
    fig, axes = plt.subplots(1, len(repeats), figsize=(4.5 * len(repeats), 4), squeeze=False)
    for ax, n in zip(axes[0], repeats):
        for variant, (c, st) in styles.items():
            sel = sorted((r for r in rows if r["needle_repeats"] == n and r["variant"] == variant),
                         key=lambda r: r["length"])
            if sel:
                ax.plot([r["length"] for r in sel], [r["accuracy"] for r in sel], st, color=c, label=variant)
        sel = sorted((r for r in rows if r["needle_repeats"] == n and r["variant"] == "sparse"),
                     key=lambda r: r["length"])
        if sel:
            ax.plot([r["length"] for r in sel], [r["needle_selected"] for r in sel], ":^", color="grey",
                    label="needle selected (sparse)")
        _length_axis(ax, lengths)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("accuracy")
        ax.set_title(f"needle (k v) x {n}")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"hand-built retrieval model ({_title_env(ret)})", fontsize=10)
    fig.tight_layout()
    p = out_dir / f"retrieval_accuracy{suffix}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return [p]


# ---------------------------------------------------------------------------------------------
# NIAH


def plot_niah(niah: dict, out_dir: Path, suffix: str) -> list[Path]:
    plt = _plt()
    modes = [m["name"] for m in niah["modes"]]
    lengths = niah["settings"]["lengths"]
    depths = niah["settings"]["depths"]
    fig, axes = plt.subplots(1, 1 + len(modes), figsize=(5 + 3.2 * len(modes), 4), squeeze=False)
    ax = axes[0][0]
    for m in modes:
        sel = sorted((r for r in niah["summary"] if r["mode"] == m), key=lambda r: r["length"])
        ax.plot([r["length"] for r in sel], [r["accuracy"] for r in sel],
                "-o" if "nocorr" not in m else "--x", label=m)
    _length_axis(ax, lengths)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy (all depths)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    for ax, m in zip(axes[0][1:], modes):
        grid = [[next(r["accuracy"] for r in niah["rows"]
                      if r["mode"] == m and r["length"] == n and r["depth"] == d) for n in lengths]
                for d in depths]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        for i, line in enumerate(grid):
            for j, acc in enumerate(line):
                ax.text(j, i, f"{acc:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([_klabel(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)))
        ax.set_yticklabels([f"{100 * d:g}%" for d in depths], fontsize=7)
        ax.set_xlabel("length")
        ax.set_ylabel("needle depth")
        ax.set_title(m, fontsize=9)
    fig.colorbar(im, ax=axes[0][-1], fraction=0.046)
    name = Path(str(niah["model"]["name"])).name
    fig.suptitle(f"NIAH, {name} ({_title_env(niah)})", fontsize=10)
    fig.tight_layout()
    p = out_dir / f"niah_accuracy{suffix}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return [p]


# ---------------------------------------------------------------------------------------------
# Markdown tables


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def markdown_fidelity(fid: dict) -> str:
    out = []
    for dtype in sorted({r["dtype"] for r in fid["rows"]}):
        for fam in fid["families"]:
            sel = [r for r in fid["rows"] if r["family"] == fam and r["dtype"] == dtype]
            if not sel:
                continue
            out.append(f"**{fam} inputs, {dtype}**\n")
            out.append("| length | alpha | density | needle recall | retained mass (mean / min) | "
                       "rel L2, correction | rel L2, none | max abs, correction | max abs, none |")
            out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            metrics = ("density", "needle_recall", "retained_mass", "retained_mass_min", "rel_l2_corrected",
                       "rel_l2_uncorrected", "max_abs_corrected", "max_abs_uncorrected")
            for n in sorted({r["seqlen"] for r in sel}):
                at_n = sorted((r for r in sel if r["seqlen"] == n), key=lambda r: r["alpha"])
                # calibrated inputs select the same blocks at every alpha: one row says so
                same = len(at_n) > 1 and all(all(r[m] == at_n[0][m] for m in metrics) for r in at_n)
                for r in at_n[:1] if same else at_n:
                    alpha = f"all ({at_n[0]['alpha']:g}-{at_n[-1]['alpha']:g})" if same else f"{r['alpha']:g}"
                    out.append(
                        f"| {_klabel(r['seqlen'])} | {alpha} | {r['density']:.4f} | "
                        f"{_fmt(r['needle_recall'], '.3f')} | {r['retained_mass']:.4f} / {r['retained_mass_min']:.4f} | "
                        f"{r['rel_l2_corrected']:.2e} | {r['rel_l2_uncorrected']:.2e} | "
                        f"{r['max_abs_corrected']:.2e} | {r['max_abs_uncorrected']:.2e} |")
            out.append("")
    floors = sorted({round(r["rel_l2_dtype_floor"], 5) for r in fid["rows"]})
    out.append(f"bf16 rounding of the exact output (rel L2): {floors[0]:.2e} to {floors[-1]:.2e}. "
               f"FP8: {fid.get('fp8')}.")
    refs = {(m["family"], m["seqlen"]): m["reference"]["query_rows"] for m in fid["inputs"]}
    sampled = [f"{f} {_klabel(n)}: {q}" for (f, n), q in refs.items() if q != "all"]
    out.append("Errors measured on every query" if not sampled else
               "Errors measured on every query except " + "; ".join(sampled))
    return "\n".join(out) + "\n"


def markdown_retrieval(ret: dict) -> str:
    out = ["| needle | length | dense | sparse | no correction | needle selected | density (layer 2) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for n in sorted({r["needle_repeats"] for r in ret["rows"]}):
        for length in sorted({r["length"] for r in ret["rows"]}):
            cell = {r["variant"]: r for r in ret["rows"] if r["needle_repeats"] == n and r["length"] == length}
            if not cell:
                continue
            out.append(f"| (k v) x {n} | {_klabel(length)} | {cell['dense']['accuracy']:.2f} | "
                       f"{cell['sparse']['accuracy']:.2f} | {cell['sparse_nocorr']['accuracy']:.2f} | "
                       f"{cell['sparse']['needle_selected']:.2f} | {cell['sparse']['density_layer2']:.3f} |")
    trials = sorted({r["trials"] for r in ret["rows"]})
    out.append(f"\n{', '.join(map(str, trials))} trials per cell.")
    return "\n".join(out) + "\n"


def markdown_niah(niah: dict) -> str:
    modes = [m["name"] for m in niah["modes"]]
    out = ["| length | " + " | ".join(modes) + " | " + " | ".join(f"density {m}" for m in modes[1:]) + " |",
           "|---:|" + "---:|" * (2 * len(modes) - 1)]
    for length in niah["settings"]["lengths"]:
        cell = {r["mode"]: r for r in niah["summary"] if r["length"] == length}
        out.append(f"| {_klabel(length)} | " + " | ".join(f"{cell[m]['accuracy']:.2f}" for m in modes) + " | "
                   + " | ".join(_fmt(cell[m]["density"], ".3f") for m in modes[1:]) + " |")
    s = niah["settings"]
    trials = s["trials"] if isinstance(s["trials"], int) else "/".join(map(str, s["trials"]))
    out.append(f"\n{len(s['depths'])} depths x {trials} trials per length; model "
               f"{Path(str(niah['model']['name'])).name}, chat template {s['chat_template']}.")
    return "\n".join(out) + "\n"


def merge_niah(payloads: list[dict | None]) -> dict | None:
    """One payload from several runs of ``evals.niah`` (e.g. short and long lengths run
    separately): rows, summary, density and samples concatenated, lengths sorted. Runs must
    share the model, modes and depths."""
    found = [p for p in payloads if p is not None]
    if len(found) <= 1:
        return found[0] if found else None
    first = found[0]
    for p in found[1:]:
        for key, get in (("model", lambda x: x["model"]["name"]), ("modes", lambda x: x["modes"]),
                         ("depths", lambda x: x["settings"]["depths"])):
            if get(p) != get(first):
                raise ValueError(f"--niah: the files differ in {key}; merge runs of one configuration only")
    seen: set[int] = set()
    for p in found:
        overlap = seen & set(p["settings"]["lengths"])
        if overlap:
            raise ValueError(f"--niah: length {sorted(overlap)} appears in more than one file")
        seen |= set(p["settings"]["lengths"])
    merged = dict(first, settings=dict(first["settings"]))
    merged["settings"]["lengths"] = sorted({n for p in found for n in p["settings"]["lengths"]})
    merged["settings"]["trials"] = sorted({p["settings"]["trials"] for p in found})
    for key in ("rows", "summary", "density", "samples"):
        merged[key] = [x for p in found for x in p.get(key, [])]
    return merged


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fidelity", type=Path, default=RESULTS / "fidelity.json")
    p.add_argument("--retrieval", type=Path, default=RESULTS / "retrieval.json")
    p.add_argument("--niah", type=Path, nargs="+", default=[RESULTS / "niah.json"],
                   help="one or more niah JSON files of the same model and modes (merged by length)")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--suffix", default="", help="appended to every PNG name (e.g. _cpu)")
    p.add_argument("--markdown", action="store_true", help="also print Markdown tables")
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    niah = merge_niah([_load(p) for p in args.niah])
    for path, payload, plot, table in ((args.fidelity, _load(args.fidelity), plot_fidelity, markdown_fidelity),
                                       (args.retrieval, _load(args.retrieval), plot_retrieval, markdown_retrieval),
                                       (args.niah[0], niah, plot_niah, markdown_niah)):
        if payload is None:
            print(f"skip: {path} not found", file=sys.stderr)
            continue
        written += plot(payload, args.out_dir, args.suffix)
        if args.markdown:
            print(f"<!-- from {path.name} -->")
            print(table(payload))
    for w in written:
        print(f"wrote {w}")
    return written


if __name__ == "__main__":
    main()
