"""The Pareto table of a calibration profile, as Markdown (for ACCURACY.md).

One block of rows per length, sparsest first: density, the KL figures, top-1 agreement,
perplexity, needle retrieval and the last-word score against dense, whether the setting meets
the profile's budget, whether it is on the density / last-256 KL Pareto front of its length
(no other setting is both sparser or as sparse and closer to dense), and the chosen setting in
bold. Predicted speed-ups are left out on purpose: they depend on the GPU cost model, not on
the density alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..sparse_profile import SparseProfile


def pareto_front(rows: Sequence[dict]) -> set[str]:
    """Settings of ``rows`` (one length) not dominated in (density, kl_last256)."""
    front = set()
    for r in rows:
        dominated = any(o is not r and o["density"] <= r["density"] and o["kl_last256"] <= r["kl_last256"]
                        and (o["density"] < r["density"] or o["kl_last256"] < r["kl_last256"]) for o in rows)
        if not dominated:
            front.add(r["setting"])
    return front


def markdown(profile: SparseProfile, *, pareto_only: bool = False) -> str:
    rows = [r for r in profile.measured if r.get("kind") == "grid"]
    dense = {r["length"]: r for r in profile.measured if r.get("kind") == "dense"}
    lastword = {r["setting"]: r for r in profile.measured if r.get("kind") == "lastword"}
    budget = profile.budget
    chosen = budget.get("chosen")
    lines = [f"Calibration of `{profile.model}` ({profile.num_layers} layers); budget: mean KL over the last 256 "
             f"positions <= {budget.get('kl_last256')}, over the last 8 <= {budget.get('kl_last8')}, needle >= dense "
             f"- {budget.get('needle_slack')}, last word >= dense - {budget.get('lastword_slack')}; "
             f"{'met' if budget.get('met') else 'NOT met'} by **{chosen}** (expected density "
             f"{profile.expected_density}).", ""]
    if not budget.get("met") and budget.get("failures"):
        lines += ["Not met: " + "; ".join(budget["failures"]), ""]
    lines += ["| length | setting | density | KL last 256 | KL last 8 | top-1 (256) | ppl dense -> sparse | needle "
              "(dense) | last word (dense) | budget | Pareto |",
              "|---:|---|---:|---:|---:|---:|---|---|---|---|---|"]
    for length in sorted({r["length"] for r in rows}):
        group = sorted((r for r in rows if r["length"] == length), key=lambda r: (r["density"], r["kl_last256"]))
        front = pareto_front(group)
        d = dense.get(length, {})
        label = f"{length}" + (" (YaRN, beyond trained)" if d.get("beyond_trained_context") else "")
        needle = f"{d['needle']}/{d['needles']}" if d.get("needle") is not None else "-"
        lines.append(f"| {label} | dense | 1 | 0 | 0 | 1 | {d.get('ppl_last256', float('nan')):.3f} | {needle} | "
                     f"{_lastword(next(iter(lastword.values()), None), dense=True)} | | |")
        for r in group:
            if pareto_only and r["setting"] not in front and r["setting"] != chosen:
                continue
            name = f"**{r['setting']}** (chosen)" if r["setting"] == chosen else r["setting"]
            needle = f"{r['needle']}/{r['needles']} ({r['needle_dense']})" if r.get("needle") is not None else "-"
            lines.append(
                f"| {label} | {name} | {r['density']:.3f} | {r['kl_last256']:.3e} | {r['kl_last8']:.3e} | "
                f"{r['top1_last256']:.3f} | {r['ppl_dense_last256']:.3f} -> {r['ppl_last256']:.3f} | {needle} | "
                f"{_lastword(lastword.get(r['setting']))} | {'meets' if r.get('meets_budget') else '-'} | "
                f"{'yes' if r['setting'] in front else ''} |")
    return "\n".join(lines) + "\n"


def _lastword(row: dict | None, dense: bool = False) -> str:
    if row is None:
        return "-"
    if dense:
        return f"{row['dense_correct']}/{row['items']}"
    return f"{row['correct']}/{row['items']} ({row['dense_correct']})"
