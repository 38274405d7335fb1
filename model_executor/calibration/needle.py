"""Needle-in-a-haystack retrieval (RULER-style, one needle): prompts, greedy answers, scoring.

A haystack of filler prose (generated here from fixed word lists by a seeded RNG: no downloads)
holds one needle sentence, ``The special magic number for <key> is <value>.``, with ``<key>`` an
adjective-noun pair and ``<value>`` a 7-digit number, inserted at a sentence boundary at the
requested depth (0% = before the first filler sentence, 100% = after the last). The question
comes at the end, as one user turn of the tokenizer's chat template when it has one (else plain
text after BOS), followed by the answer prefix ``The special magic number for <key> mentioned in
the provided text is`` (as RULER does). A prompt is as long as possible within ``length -
reserve`` tokens (``reserve``: room for the answer). A sample is correct when the value appears
in the decoded answer as a whole digit run (RULER's string match, strict about neighbouring
digits).

``evals/niah.py`` runs this task through the whole offline generator; :func:`greedy_answers`
runs it on a :class:`~model_executor.runner.ModelRunner` directly (prefill with a given sparse
config, dense paged decode), which is what the calibration does.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kernels.config import SparseConfig

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
INSTRUCTION = (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards."
)
NEEDLE = "The special magic number for {key} is {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"

# ---------------------------------------------------------------------------------------------
# Filler text: seeded sentences over fixed word lists (no digits, never the needle's words)

SUBJECTS = (
    "the old harbor", "a quiet village", "the river", "our small committee", "the city library",
    "the morning train", "a travelling painter", "the northern valley", "the school orchestra",
    "an elderly carpenter", "the weekly market", "a curious student", "the mountain road",
    "the museum guide", "a patient gardener", "the night watchman", "the village bakery",
    "a young engineer", "the coastal path", "the town council", "the farmer next door",
    "a retired sailor", "the local newspaper", "the forest ranger", "the winter festival",
)
VERBS = (
    "remembered", "described", "admired", "ignored", "rebuilt", "visited", "painted",
    "welcomed", "questioned", "followed", "celebrated", "measured", "repaired", "studied",
    "crossed", "praised", "explored", "organized", "photographed", "avoided",
)
OBJECTS = (
    "the stone bridge", "a row of chestnut trees", "the abandoned mill", "the long corridor",
    "an unfinished letter", "the crowded square", "a set of brass keys", "the wooden fence",
    "the distant lighthouse", "a basket of apples", "the narrow staircase", "the green door",
    "a forgotten song", "the empty theater", "the muddy field", "a pair of old boots",
    "the quiet chapel", "the painted ceiling", "a map of the island", "the garden wall",
)
TAILS = (
    "before the rain began", "late in the afternoon", "with unusual care", "without a word",
    "as the bells rang", "during the long summer", "after the storm had passed",
    "while the others slept", "under a pale sky", "for the first time in years",
    "in the early morning", "despite the cold wind", "with a few close friends",
    "as if nothing had changed", "when the lamps were lit", "at the edge of town",
)
CLAUSES = (
    "Nobody could say why it mattered so much.", "It was, by all accounts, an ordinary day.",
    "Some people still talk about it.", "The details were written down much later.",
    "Everyone agreed that it had been worth the effort.", "Little else happened that week.",
    "The reasons were never entirely clear.", "It became a story told at every gathering.",
)
ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly",
    "kind", "lucky", "mellow", "noble", "odd", "proud", "quick", "rusty", "silent", "tidy",
    "vivid", "witty", "young", "zealous", "crimson", "golden", "hidden", "silver", "sturdy",
)
NOUNS = (
    "falcon", "harbor", "lantern", "meadow", "otter", "pebble", "quill", "raven", "saddle",
    "thistle", "umbrella", "violin", "walrus", "willow", "anchor", "beacon", "canyon", "dolphin",
    "ember", "fjord", "glacier", "hammock", "island", "jasmine", "kettle", "lagoon", "marble",
)


def filler_sentence(rng: random.Random) -> str:
    """One sentence of filler prose."""
    if rng.random() < 0.12:
        return rng.choice(CLAUSES)
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}."
    return s[0].upper() + s[1:]


def make_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


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




def greedy_answers(runner, prompts: Sequence[Sequence[int]], sparse_config: SparseConfig | None, *,
                   max_new_tokens: int, stop_ids: Sequence[int] = (), rid_prefix: str = "needle",
                   ) -> list[list[int]]:
    """Greedy answers to ``prompts``, all in one batch: one prefill forward with ``sparse_config``
    (``None``: the runner's; ``alpha = 0``: dense), then dense paged decode steps until each
    answer has ``max_new_tokens`` tokens or a stop token (kept). The runner's pool must hold ``len(prompt) + max_new_tokens`` tokens for every prompt; the
    pages are released afterwards."""
    from model_executor.runner import PrefillItem

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    rids = [f"{rid_prefix}-{i}" for i in range(len(prompts))]
    stop = set(int(s) for s in stop_ids)
    held: list[str] = []
    try:
        for rid, ids in zip(rids, prompts):
            runner.pool.reserve(rid, len(ids) + max_new_tokens)
            held.append(rid)
        logits = runner.prefill_keeping([PrefillItem(r, list(p)) for r, p in zip(rids, prompts)],
                                        sparse_config=sparse_config)[0]
        answers = [[int(t)] for t in logits.argmax(-1).tolist()]
        live = [i for i, a in enumerate(answers) if a[-1] not in stop and max_new_tokens > 1]
        while live:
            step = runner.decode([rids[i] for i in live], [answers[i][-1] for i in live])
            for i, t in zip(live, step.argmax(-1).tolist()):
                answers[i].append(int(t))
            live = [i for i in live if answers[i][-1] not in stop and len(answers[i]) < max_new_tokens]
    finally:
        for rid in held:
            runner.pool.release(rid)
    return answers
