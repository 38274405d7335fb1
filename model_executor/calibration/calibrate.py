"""Calibration of a model's sparse prefill to a quality budget (``python -m router calibrate``).

For every length and every grid point (:mod:`.grid`), against dense prefill of the same model
(the same RoPE scaling beyond the trained context), with sparse attention forced on
(``dense_below = 0``), whole-prompt prefill (one forward per batch of prompts):

- **answer KL**: ``KL(dense || sparse)`` of the next-token distributions at the last 8 positions
  of each of ``prompts`` text windows (``prompts_beyond_trained`` beyond the trained context;
  :func:`~.text.ending_windows`: windows of the length
  whose ends are spread over the text, so their last positions, where an answer starts, differ);
- **last-256 KL, top-1 agreement, perplexity** over the last 256 positions of the same windows
  (what prompt logprobs and lm-eval continuations read); perplexity of the text's next tokens;
- **block density**: selected over causal (128-query, 64-key) tile pairs of those forwards, over
  every layer and KV head (dense layers count as fully selected);
- **needle retrieval**: ``needles`` prompts (:mod:`.needle`, depths 0..100% in turn), prefilled
  with the setting, answered by dense greedy decoding;
- **last word** (once per setting, not per length): the shipped lm-eval task's items
  (:mod:`.lastword`), greedy accuracy of the target word.

Per-layer sensitivity (the ``sensitivity`` schedule) is measured once, before the grid, at
``sensitivity_length`` (default: the longest calibration length within the trained context):
the last-256 KL when only layer ``l`` runs sparse, at the grid's largest alpha, its first energy
rule and no dense tiles.

**Selection.** A setting meets the budget when, at every length at or above ``dense_below``
(all lengths when None): the mean last-256 KL is at most ``kl``, the mean last-8 KL at most
``kl_last``, needle retrieval at least dense's minus ``needle_slack``; and last-word accuracy
at least dense's minus ``lastword_slack`` items. Of those, the sparsest (lowest mean density
over those lengths) is chosen. If none meets it, the *best* is written anyway, with
``budget.met = false`` and the reasons: the fewest failed checks, then the lowest summed
last-256 KL, then the lowest density. The command exits 0 when the budget is met, 1 when not
(the profile is still written), 2 for bad arguments. A ``max_seconds`` guard stops measuring
(lengths not reached are missing from the profile, which then does not meet the budget).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence

import torch

from kernels.config import SparseConfig

from . import lastword, needle
from .forwards import Clock, OutOfTime, tail_logits, tail_summary, token_batches
from .grid import GridPoint
from .metrics import compare_logits
from .selection import Result, judge, profile_options, select
from .settings import TAIL, Budget, Settings
from .text import ending_windows, load_text, rope_for

DEPTHS = needle.DEPTHS
# the run's pieces, by job: .settings (the options and the budget), .forwards (one forward's
# logits and density, batching, the time guard), .selection (the verdicts and the profile);
# Budget, OutOfTime, Settings and judge are re-exported as the command's API


class _Calibration:
    def __init__(self, settings: Settings, log: Callable[[str], None]) -> None:
        from ..loading import load_model

        self.s = settings
        self.log = log
        self.clock = Clock(settings.max_seconds, log)
        self.dense = dataclasses.replace(settings.base, alpha=0.0)
        s = settings
        self.base_model = load_model(s.model, dtype=s.dtype, device=s.device, seed=s.seed)
        if self.base_model.tokenizer is None:
            raise ValueError(f"--model: {s.model} has no tokenizer; the calibration tokenizes text")
        self.tokenizer = self.base_model.tokenizer
        self.num_layers = self.base_model.num_layers
        self.trained = int(self.base_model.config.max_position_embeddings)
        self.text = load_text(s.text)
        self.ids = self.tokenizer.encode(self.text.text, add_bos=False)
        # every prompt is built before the first forward: a length the text, the needle task or the
        # model cannot hold fails here, not an hour in
        try:
            self.windows = {n: ending_windows(self.ids, n, self.prompts_at(n)) for n in s.lengths}
        except ValueError as exc:  # "length: ..." / "prompts: ..." of the text's windows
            raise ValueError(f"--{'lengths' if str(exc).startswith('length') else 'prompts'}: {exc}") from None
        self.needles = {n: self.needle_samples(n) for n in s.lengths} if s.needles else {}
        self.lastword = self.lastword_prompts() if s.lastword_items else []
        self.loaded_rope: str | None = None
        self.loaded = self.base_model
        self.rows: list[dict] = []
        self.incomplete: list[str] = []

    def prompts_at(self, length: int) -> int:
        s = self.s
        beyond = length > self.trained and s.prompts_beyond_trained is not None
        return s.prompts_beyond_trained if beyond else s.prompts

    # -- models and runners ----------------------------------------------------------------------
    def model_for(self, length: int):
        from ..loading import load_model

        rope = rope_for(length, self.trained, self.s.rope_scaling)
        key = None if rope is None else json.dumps(rope, sort_keys=True)
        if key != self.loaded_rope:
            self.loaded = None  # one model in memory at a time
            self.loaded = (self.base_model if rope is None else
                           load_model(self.s.model, dtype=self.s.dtype, device=self.s.device, seed=self.s.seed,
                                      rope_scaling=rope))
            self.loaded_rope = key
            self.log(f"model with RoPE {rope or 'as trained'}")
        return self.loaded, rope

    def runner_for(self, loaded, tokens: int):
        from ..loading import make_pool
        from ..runner import ModelRunner

        page = 64
        pool = make_pool(loaded, num_pages=-(-tokens // page) + 2, page_size=page)
        return ModelRunner(loaded.model, pool, self.s.base, dense_below=0, backend=self.s.backend)

    def _pool_tokens(self, sizes: Sequence[int], batches: Sequence[Sequence[int]], extra: int = 0) -> int:
        page = 64
        return max(sum(-(-(sizes[i] + extra) // page) * page for i in b) for b in batches)

    # -- measurements ----------------------------------------------------------------------------
    def tail_metrics(self, runner, windows, configs: dict[str, SparseConfig]) -> dict[str, dict]:
        """Per config name: the last-256 and last-8 comparisons with dense and density counts."""
        sizes = [len(w) for w, _ in windows]
        parts = {name: ([], [0, 0]) for name in configs}
        for batch in token_batches(sizes, self.s.batch_tokens):
            ws = [windows[i][0] for i in batch]
            targets = [torch.tensor(w[len(w) - TAIL + 1:] + [nxt], dtype=torch.int64)
                       for w, nxt in (windows[i] for i in batch)]
            ref, _ = tail_logits(runner, ws, self.dense, self.num_layers, TAIL)
            self.clock.tick()
            for name, config in configs.items():
                got, (sel, tot) = tail_logits(runner, ws, config, self.num_layers, TAIL)
                self.clock.tick()
                comps, tiles = parts[name]
                comps.extend(compare_logits(r, g, t) for r, g, t in zip(ref, got, targets))
                tiles[0] += sel
                tiles[1] += tot
                del got
            del ref
        return {name: tail_summary(comps, tiles) for name, (comps, tiles) in parts.items()}

    @property
    def sensitivity_length(self) -> int:
        """``--sensitivity-length``, else the longest length within the trained context (else the shortest)."""
        s = self.s
        return s.sensitivity_length or max([n for n in s.lengths if n <= self.trained] or [min(s.lengths)])

    def sensitivity(self) -> list[float] | None:
        s = self.s
        points = [p for p in s.grid if p.schedule == "sensitivity"]
        if not points:
            return None
        length = self.sensitivity_length
        alpha = max(p.alpha for p in points)
        rule = points[0].energy_rule
        loaded = self.base_model if length <= self.trained else self.model_for(length)[0]
        windows = self.windows[length][:s.sensitivity_prompts]
        batches = token_batches([length] * len(windows), s.batch_tokens)
        runner = self.runner_for(loaded, self._pool_tokens([length] * len(windows), batches))
        configs = {}
        for layer in range(self.num_layers):
            configs[f"layer{layer}"] = dataclasses.replace(
                s.base, alpha=alpha, energy_rule=rule, last_dense_tiles=0, dense_layers=0,
                layer_alpha=tuple(alpha if i == layer else 0.0 for i in range(self.num_layers)))
        self.log(f"per-layer sensitivity at {length} tokens, alpha {alpha:g}, {rule}: "
                 f"{len(batches) * (1 + self.num_layers)} forwards")
        got = self.tail_metrics(runner, windows, configs)
        values = [got[f"layer{i}"]["kl_last256"] for i in range(self.num_layers)]
        self.rows.append({"kind": "layer_sensitivity", "length": length, "alpha": alpha, "energy_rule": rule,
                          "prompts": len(windows), "kl_last256": values})
        self.log("sensitivity (KL last 256 per layer): " + " ".join(f"{v:.2e}" for v in values))
        return values

    def needle_samples(self, length: int) -> list[needle.Sample]:
        """``needles`` prompts of ``length`` tokens (answer included), depths 0..100% in turn."""
        s = self.s
        chat = needle.has_chat_template(self.tokenizer)
        stacks = [needle.Haystack(self.tokenizer, s.seed, t) for t in range(-(-s.needles // len(DEPTHS)))]
        try:
            return [needle.build_sample(self.tokenizer, stacks[i // len(DEPTHS)], length, DEPTHS[i % len(DEPTHS)],
                                        i // len(DEPTHS), s.seed, chat=chat, answer_prefix=True,
                                        reserve=s.needle_new_tokens) for i in range(s.needles)]
        except ValueError as exc:
            raise ValueError(f"--lengths: {exc}") from None

    def lastword_prompts(self) -> list[tuple[list[int], int]]:
        s = self.s
        try:
            items = lastword.build_items(s.lastword_items, s.lastword_chars, self.text.text)
        except ValueError as exc:
            raise ValueError(f"--lastword-items: {exc}") from None
        encoded = [lastword.encode_item(self.tokenizer, it) for it in items]
        longest = max(len(ids) for ids, _ in encoded)
        if longest > self.trained:
            raise ValueError(f"--lastword-chars: {s.lastword_chars} characters make up to {longest} tokens, beyond "
                             f"the model's trained context ({self.trained})")
        return encoded

    def needle_sizes(self, length: int) -> list[int]:
        return [len(x.prompt_ids) + self.s.needle_new_tokens for x in self.needles.get(length, ())]

    def needle_counts(self, runner, loaded, length: int, configs: dict[str, SparseConfig]) -> dict[str, int]:
        s = self.s
        samples = self.needles[length]
        stop = needle.stop_token_ids(loaded)
        correct = {"dense": 0, **{name: 0 for name in configs}}
        sizes = self.needle_sizes(length)
        for batch in token_batches(sizes, s.batch_tokens):
            prompts = [samples[i].prompt_ids for i in batch]
            for name, config in (("dense", self.dense), *configs.items()):
                answers = needle.greedy_answers(runner, prompts, config, max_new_tokens=s.needle_new_tokens,
                                                stop_ids=stop)
                self.clock.tick()
                correct[name] += sum(needle.is_correct(samples[i].value, self.tokenizer.decode(a))
                                     for i, a in zip(batch, answers))
        return correct

    def lastword_counts(self, configs: dict[str, SparseConfig]) -> None:
        s = self.s
        encoded = self.lastword
        sizes = [len(ids) for ids, _ in encoded]
        batches = token_batches(sizes, s.batch_tokens)
        runner = self.runner_for(self.base_model, self._pool_tokens(sizes, batches))
        self.log(f"last word: {len(encoded)} items of {min(sizes)}-{max(sizes)} tokens, "
                 f"{len(batches) * (1 + len(configs))} forwards")
        from ..runner import PrefillItem

        correct = {"dense": 0, **{name: 0 for name in configs}}
        for batch in batches:
            rids = [f"lastword-{i}" for i in batch]
            for name, config in (("dense", self.dense), *configs.items()):
                held = []
                try:
                    for rid, i in zip(rids, batch):
                        runner.pool.reserve(rid, sizes[i])
                        held.append(rid)
                    _, kept = runner.prefill_keeping([PrefillItem(r, encoded[i][0]) for r, i in zip(rids, batch)],
                                                     keep_all=[True] * len(batch), sparse_config=config)
                    correct[name] += sum(lastword.greedy_hit(kept[j], *encoded[i]) for j, i in enumerate(batch))
                    del kept
                finally:
                    for rid in held:
                        runner.pool.release(rid)
                self.clock.tick()
        for name in configs:
            self.rows.append({"kind": "lastword", "setting": name, "items": len(encoded), "correct": correct[name],
                              "dense_correct": correct["dense"], "context_chars": s.lastword_chars,
                              "tokens": [min(sizes), max(sizes)]})
        sparse = [correct[n] for n in configs]
        self.log(f"last word: dense {correct['dense']}/{len(encoded)}, the settings {min(sparse)}..{max(sparse)} "
                 f"(total {self.clock.elapsed:.0f} s)")

    def length(self, length: int, configs: dict[str, SparseConfig], points: dict[str, GridPoint]) -> None:
        s = self.s
        loaded, rope = self.model_for(length)
        windows = self.windows[length]
        tokens = self._pool_tokens([length] * len(windows), token_batches([length] * len(windows), s.batch_tokens))
        if s.needles:
            sizes = self.needle_sizes(length)
            tokens = max(tokens, self._pool_tokens(sizes, token_batches(sizes, s.batch_tokens)))
        runner = self.runner_for(loaded, tokens)
        t0 = time.perf_counter()
        tails = self.tail_metrics(runner, windows, configs)
        needles = self.needle_counts(runner, loaded, length, configs) if s.needles else None
        beyond = length > self.trained
        self.rows.append({"kind": "dense", "length": length, "rope_scaling": rope, "beyond_trained_context": beyond,
                          "prompts": len(windows), "needle": needles and needles["dense"], "needles": s.needles,
                          "ppl_last256": next(iter(tails.values()))["ppl_dense_last256"] if tails else None})
        for name, config in configs.items():
            row = {"kind": "grid", "setting": name, "sparse": profile_options(config), "length": length,
                   "rope_scaling": rope, "beyond_trained_context": beyond, "prompts": len(windows), **tails[name],
                   "needle": needles and needles[name], "needle_dense": needles and needles["dense"],
                   "needles": s.needles, "schedule": points[name].schedule}
            self.rows.append(row)
        best = min(tails, key=lambda n: tails[n]["density"])
        self.log(f"L={length}{' (beyond the trained context)' if beyond else ''}: {len(configs)} settings in "
                 f"{time.perf_counter() - t0:.0f} s (total {self.clock.elapsed:.0f} s); sparsest {best} density "
                 f"{tails[best]['density']:.3f} KL256 {tails[best]['kl_last256']:.3e}"
                 + (f" needle {needles[best]}/{s.needles} (dense {needles['dense']})" if needles else ""))

    def plan_forwards(self, sensitivity: bool) -> str:
        s = self.s
        g = len(s.grid)
        parts, total = [], 0
        for n in s.lengths:
            kl = len(token_batches([n] * self.prompts_at(n), s.batch_tokens))
            sizes = self.needle_sizes(n)
            nd = len(token_batches(sizes, s.batch_tokens))
            total += (kl + nd) * (1 + g)
            parts.append(f"{n}: {(kl + nd) * (1 + g)}")
        if sensitivity:
            n = self.sensitivity_length
            m = min(s.sensitivity_prompts, self.prompts_at(n))
            k = len(token_batches([n] * m, s.batch_tokens)) * (1 + self.num_layers)
            total += k
            parts.append(f"sensitivity at {n}: {k}")
        if s.lastword_items:
            sizes = [len(ids) for ids, _ in self.lastword]
            k = len(token_batches(sizes, s.batch_tokens)) * (1 + g)
            parts.append(f"last word: {k}")
            total += k
        needle_batches = sum(len(token_batches(self.needle_sizes(n), s.batch_tokens)) for n in s.lengths)
        steps = (s.needle_new_tokens - 1) * (1 + g) * needle_batches
        return (f"{g} settings + dense; {total} prefill forwards ({', '.join(parts)}) and at most {steps} "
                "batched decode steps")

    def run(self, argv: Sequence[str] | None) -> Result:
        s = self.s
        points = {p.name: p for p in s.grid}
        needs_sens = any(p.schedule == "sensitivity" for p in s.grid)
        self.log(f"calibrating {s.model} ({self.num_layers} layers, trained context {self.trained}) on "
                 f"{s.device}: lengths {list(s.lengths)}, {s.prompts} prompts, {s.needles} needles, "
                 f"{s.lastword_items} last-word items")
        self.log("plan: " + self.plan_forwards(needs_sens))
        sensitivity = None
        try:
            sensitivity = self.sensitivity() if needs_sens else None
            configs = {name: p.config(s.base, sensitivity) for name, p in points.items()}
            if s.lastword_items:
                self.lastword_counts(configs)
            for n in s.lengths:
                self.length(n, configs, points)
        except OutOfTime as exc:
            self.log(f"stopped: {exc}")
            self.incomplete.append(f"incomplete: {exc}")
            configs = {name: p.config(s.base, sensitivity) for name, p in points.items()
                       if sensitivity is not None or p.schedule != "sensitivity"}
        if not configs:
            raise OutOfTime(f"--max-seconds: {self.incomplete[0]}, before any setting could be measured")
        return select(s, configs, self.rows, num_layers=self.num_layers, incomplete=self.incomplete,
                      provenance=self.provenance(argv))

    def provenance(self, argv: Sequence[str] | None) -> dict:
        import shlex

        s = self.s
        versions = {"python": sys.version.split()[0], "torch": torch.__version__}
        for mod in ("triton", "transformers"):
            try:
                versions[mod] = __import__(mod).__version__
            except ImportError:
                versions[mod] = None
        device = torch.cuda.get_device_name(0) if s.device == "cuda" else (platform.processor() or platform.machine())
        param = next(self.base_model.model.parameters())
        return {
            "command": "python -m router calibrate " + shlex.join(argv) if argv is not None else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": f"{s.device}: {device}", "versions": versions, "backend": s.backend,
            "dtype": str(param.dtype).replace("torch.", ""), "seed": s.seed,
            "text": {"name": self.text.name, "sha256": self.text.sha256, "tokens": len(self.ids)},
            "trained_context": self.trained, "rope_scaling": s.rope_scaling, "prompts": s.prompts,
            "needles": s.needles, "needle_new_tokens": s.needle_new_tokens, "lastword_items": s.lastword_items,
            "seconds": round(self.clock.elapsed, 1), "forwards": self.clock.forwards,
        }


def calibrate(settings: Settings, *, argv: Sequence[str] | None = None,
              log: Callable[[str], None] = lambda _m: None) -> Result:
    """Run the calibration (module docstring); returns the profile (not yet written) and the verdict."""
    return _Calibration(settings, log).run(argv)


__all__ = ["Budget", "OutOfTime", "Result", "Settings", "calibrate", "judge"]
