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
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.config import SparseConfig

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
ALPHAS = (0.1,)
MAX_NEW_TOKENS = 32

INSTRUCTION = (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards."
)
NEEDLE = "The special magic number for {key} is {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"

# ---------------------------------------------------------------------------------------------
# Filler text: seeded sentences over fixed word lists (no digits, never the needle's words)

_SUBJECTS = (
    "the old harbor", "a quiet village", "the river", "our small committee", "the city library",
    "the morning train", "a travelling painter", "the northern valley", "the school orchestra",
    "an elderly carpenter", "the weekly market", "a curious student", "the mountain road",
    "the museum guide", "a patient gardener", "the night watchman", "the village bakery",
    "a young engineer", "the coastal path", "the town council", "the farmer next door",
    "a retired sailor", "the local newspaper", "the forest ranger", "the winter festival",
)
_VERBS = (
    "remembered", "described", "admired", "ignored", "rebuilt", "visited", "painted",
    "welcomed", "questioned", "followed", "celebrated", "measured", "repaired", "studied",
    "crossed", "praised", "explored", "organized", "photographed", "avoided",
)
_OBJECTS = (
    "the stone bridge", "a row of chestnut trees", "the abandoned mill", "the long corridor",
    "an unfinished letter", "the crowded square", "a set of brass keys", "the wooden fence",
    "the distant lighthouse", "a basket of apples", "the narrow staircase", "the green door",
    "a forgotten song", "the empty theater", "the muddy field", "a pair of old boots",
    "the quiet chapel", "the painted ceiling", "a map of the island", "the garden wall",
)
_TAILS = (
    "before the rain began", "late in the afternoon", "with unusual care", "without a word",
    "as the bells rang", "during the long summer", "after the storm had passed",
    "while the others slept", "under a pale sky", "for the first time in years",
    "in the early morning", "despite the cold wind", "with a few close friends",
    "as if nothing had changed", "when the lamps were lit", "at the edge of town",
)
_CLAUSES = (
    "Nobody could say why it mattered so much.", "It was, by all accounts, an ordinary day.",
    "Some people still talk about it.", "The details were written down much later.",
    "Everyone agreed that it had been worth the effort.", "Little else happened that week.",
    "The reasons were never entirely clear.", "It became a story told at every gathering.",
)
_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly",
    "kind", "lucky", "mellow", "noble", "odd", "proud", "quick", "rusty", "silent", "tidy",
    "vivid", "witty", "young", "zealous", "crimson", "golden", "hidden", "silver", "sturdy",
)
_NOUNS = (
    "falcon", "harbor", "lantern", "meadow", "otter", "pebble", "quill", "raven", "saddle",
    "thistle", "umbrella", "violin", "walrus", "willow", "anchor", "beacon", "canyon", "dolphin",
    "ember", "fjord", "glacier", "hammock", "island", "jasmine", "kettle", "lagoon", "marble",
)


def filler_sentence(rng: random.Random) -> str:
    """One sentence of filler prose."""
    if rng.random() < 0.12:
        return rng.choice(_CLAUSES)
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
    return s[0].upper() + s[1:]


def make_key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def make_value(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _stream_seed(seed: int, *parts: int) -> int:
    """A stable seed from integers (no Python hash randomisation)."""
    x = seed & 0xFFFFFFFF
    for p in parts:
        x = (x * 1_000_003 + int(p) + 7) & 0xFFFFFFFFFFFF
    return x


class Haystack:
    """The filler sentence stream of one trial and the token count of each sentence (with its
    leading space), extended on demand."""

    def __init__(self, tokenizer, seed: int, trial: int) -> None:
        self.tokenizer = tokenizer
        self._rng = random.Random(_stream_seed(seed, 1, trial))
        self.sentences: list[str] = []
        self.tokens: list[int] = []

    def ensure(self, n_tokens: int) -> None:
        """Hold at least ``n_tokens`` tokens of sentences."""
        total = sum(self.tokens)
        while total < n_tokens:
            s = filler_sentence(self._rng)
            n = len(self.tokenizer.encode(" " + s, add_bos=False))
            self.sentences.append(s)
            self.tokens.append(n)
            total += n


# ---------------------------------------------------------------------------------------------
# Prompts


@dataclass(frozen=True)
class Sample:
    length: int  # the context length asked for, in tokens
    depth: float  # the depth asked for, in [0, 1]
    trial: int
    key: str
    value: str
    prompt_ids: tuple[int, ...]
    needle_depth: float  # where the needle ended up: filler tokens before it / all filler tokens
    filler_sentences: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def has_chat_template(tokenizer) -> bool:
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:
        return bool(getattr(hf, "chat_template", None))
    return hasattr(tokenizer, "apply_chat_template")


def encode_prompt(tokenizer, context: str, key: str, *, chat: bool, answer_prefix: bool) -> list[int]:
    """Token ids of the whole prompt around ``context`` (the haystack with its needle)."""
    user = f"{INSTRUCTION}\n\n{context}\n\n{QUESTION.format(key=key)}"
    prefix = ANSWER_PREFIX.format(key=key) if answer_prefix else ""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
        return list(ids) + (tokenizer.encode(prefix, add_bos=False) if prefix else [])
    text = user + ("\n\n" + prefix if prefix else "\n\nAnswer:")
    return tokenizer.encode(text, add_bos=True)


def _context(sentences: Sequence[str], cut: int, needle: str) -> str:
    return " ".join([*sentences[:cut], needle, *sentences[cut:]])


def build_sample(
    tokenizer, haystack: Haystack, length: int, depth: float, trial: int, seed: int, *,
    chat: bool, answer_prefix: bool, reserve: int = 0, max_iters: int = 8,
) -> Sample:
    """The longest prompt of at most ``length - reserve`` tokens (``reserve``: room for the
    answer) with the needle at ``depth``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a fraction in [0, 1], got {depth}")
    context_length, length = length, length - reserve
    rng = random.Random(_stream_seed(seed, 2, length, round(depth * 10_000), trial))
    key, value = make_key(rng), make_value(rng)
    needle = NEEDLE.format(key=key, value=value)
    overhead = len(encode_prompt(tokenizer, needle, key, chat=chat, answer_prefix=answer_prefix))
    if overhead > length:
        raise ValueError(
            f"length: {context_length} tokens (minus {reserve} for the answer) cannot hold the "
            f"question and the needle ({overhead} tokens)"
        )
    haystack.ensure(length)
    cum = [0]
    for n in haystack.tokens:
        cum.append(cum[-1] + n)

    def count_for(budget: int) -> int:  # most sentences whose summed counts fit in budget
        lo, hi = 0, len(haystack.tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cum[mid] <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def assemble(n: int) -> tuple[list[int], int]:
        target = depth * cum[n]
        cut = min(range(n + 1), key=lambda i: (abs(cum[i] - target), i))
        ids = encode_prompt(tokenizer, _context(haystack.sentences[:n], cut, needle), key,
                            chat=chat, answer_prefix=answer_prefix)
        return ids, cut

    n = count_for(length - overhead)
    best, tried = None, set()
    for _ in range(max_iters):
        if n in tried:
            break
        tried.add(n)
        ids, cut = assemble(n)
        gap = length - len(ids)
        if gap >= 0:
            if best is None or n > best[0]:
                best = (n, ids, cut)
            if n < len(haystack.tokens) and gap >= haystack.tokens[n]:
                n = count_for(cum[n] + gap)  # room for more sentences
                continue
            break
        n = min(count_for(cum[n] + gap), n - 1)  # over by -gap tokens: drop that many
    while best is None:  # tokenisation at the joins can add tokens: shrink until it fits
        n -= 1
        ids, cut = assemble(n)
        if len(ids) <= length:
            best = (n, ids, cut)
    n, ids, cut = best
    return Sample(length=context_length, depth=depth, trial=trial, key=key, value=value,
                  prompt_ids=tuple(int(i) for i in ids),
                  needle_depth=(cum[cut] / cum[n]) if cum[n] else depth, filler_sentences=n)


def build_samples(tokenizer, lengths: Sequence[int], depths: Sequence[float], trials: int, seed: int,
                  *, chat: bool, answer_prefix: bool, reserve: int = 0) -> list[Sample]:
    """Every (length, depth, trial) sample, in that order (prompts of at most ``length -
    reserve`` tokens)."""
    out = []
    stacks = [Haystack(tokenizer, seed, t) for t in range(trials)]
    for length in lengths:
        for depth in depths:
            for t in range(trials):
                out.append(build_sample(tokenizer, stacks[t], length, depth, t, seed,
                                        chat=chat, answer_prefix=answer_prefix, reserve=reserve))
    return out


def is_correct(value: str, text: str) -> bool:
    return re.search(rf"(?<!\d){re.escape(value)}(?!\d)", text) is not None


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


def stop_token_ids(loaded) -> tuple[int, ...]:
    """End of text / end of turn of the tokenizer and of the model's generation config."""
    ids = set(getattr(loaded.tokenizer, "stop_token_ids", ()) or ())
    gen_cfg = getattr(loaded.model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return tuple(sorted(ids))


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
