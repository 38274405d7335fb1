"""The calibration's verdict: each setting against the budget (:func:`judge`), the chosen one
(:func:`select`) and its profile (``model_executor.sparse_profile.SparseProfile``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kernels.config import SparseConfig

from ..sparse_profile import PROFILE_FIELDS, SparseProfile
from .settings import Budget, Settings


@dataclass
class Result:
    profile: SparseProfile
    met: bool
    chosen: str
    failures: list[str]


def judge(rows: Sequence[dict], setting: str, lengths: Sequence[int], budget: Budget, lastword_measured: bool) -> dict:
    """A setting's verdict from the measured rows: ``failures`` (empty: meets the budget), its mean
    density over ``lengths`` (inf when a length is missing) and summed last-256 KL."""
    failures = []
    by_length = {r["length"]: r for r in rows if r["kind"] == "grid" and r["setting"] == setting}
    dens, kl_sum = [], 0.0
    for n in lengths:
        r = by_length.get(n)
        if r is None:
            failures.append(f"L={n}: not measured")
            continue
        dens.append(r["density"])
        kl_sum += r["kl_last256"]
        if not r["kl_last256"] <= budget.kl:
            failures.append(f"L={n}: KL last 256 {r['kl_last256']:.3e} > {budget.kl:g}")
        if not r["kl_last8"] <= budget.kl_last:
            failures.append(f"L={n}: KL last 8 {r['kl_last8']:.3e} > {budget.kl_last:g}")
        if r["needle"] is not None and r["needle"] < r["needle_dense"] - budget.needle_slack:
            failures.append(f"L={n}: needle {r['needle']}/{r['needles']} < dense {r['needle_dense']} - "
                            f"{budget.needle_slack}")
    if lastword_measured:
        lw = next((r for r in rows if r["kind"] == "lastword" and r["setting"] == setting), None)
        if lw is None:
            failures.append("last word: not measured")
        elif lw["correct"] < lw["dense_correct"] - budget.lastword_slack:
            failures.append(f"last word {lw['correct']}/{lw['items']} < dense {lw['dense_correct']} - "
                            f"{budget.lastword_slack}")
    density = sum(dens) / len(dens) if dens and len(dens) == len(lengths) else math.inf
    return {"failures": failures, "density": density, "kl_sum": kl_sum if dens else math.inf}


def select(s: Settings, configs: dict[str, SparseConfig], rows: list[dict], *, num_layers: int,
           incomplete: Sequence[str], provenance: dict) -> Result:
    """The chosen setting (module docstring of :mod:`.calibrate`: the sparsest that meets the budget,
    else the best) and its profile; marks each grid row of ``rows`` with its verdict."""
    verdicts = {name: judge(rows, name, s.scored_lengths, s.budget, s.lastword_items > 0) for name in configs}
    passing = [n for n, v in verdicts.items() if not v["failures"]]
    order = list(configs)
    if passing:
        chosen = min(passing, key=lambda n: (verdicts[n]["density"], verdicts[n]["kl_sum"], order.index(n)))
    else:
        chosen = min(configs, key=lambda n: (len(verdicts[n]["failures"]), verdicts[n]["kl_sum"],
                                             verdicts[n]["density"], order.index(n)))
    failures = list(verdicts[chosen]["failures"]) + list(incomplete)
    met = not failures
    for row in rows:
        if row.get("setting") in verdicts and row["kind"] == "grid":
            row["meets_budget"] = not verdicts[row["setting"]]["failures"]
            row["chosen"] = row["setting"] == chosen
    density = verdicts[chosen]["density"]
    profile = SparseProfile(
        model=s.model_name or s.model, num_layers=num_layers,
        sparse=profile_options(configs[chosen]), dense_below=s.dense_below,
        expected_density=None if math.isinf(density) else round(density, 6),
        budget={"kl_last256": s.budget.kl, "kl_last8": s.budget.kl_last, "needle_slack": s.budget.needle_slack,
                "lastword_slack": s.budget.lastword_slack, "lengths": list(s.scored_lengths), "met": met,
                "chosen": chosen, "failures": failures,
                "rule": "every length >= dense_below: mean KL last 256 <= kl_last256, mean KL last 8 <= kl_last8, "
                        "needle >= dense - needle_slack; last word >= dense - lastword_slack; sparsest such"},
        measured=rows, provenance=provenance,
    )
    return Result(profile=profile, met=met, chosen=chosen, failures=failures)


def profile_options(config: SparseConfig) -> dict:
    """A setting as a profile's ``sparse`` options (plain JSON values)."""
    out = {k: getattr(config, k) for k in PROFILE_FIELDS}
    if out["layer_alpha"] is not None:
        out["layer_alpha"] = list(out["layer_alpha"])
    return out


__all__ = ["Result", "judge", "profile_options", "select"]
