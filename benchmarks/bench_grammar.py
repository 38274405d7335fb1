"""Cost of constrained decoding on the host (model_executor/grammar.py, llguidance), CPU.

For each tokenizer and spec: the tokenizer's one-off conversion for llguidance, the grammar's
compile (a cache miss: ``LLMatcher`` construction) and a cache hit (a deep copy), and the
per-token cost of ``fill_mask`` (host bitmask + expansion over the logits) plus ``accept``,
over a generation sampled from seeded random logits until the grammar ends (or
``--max-tokens``). Times are CPU time of this thread (``time.thread_time_ns``), so other load
on the machine changes little; wall-clock medians are kept beside them.

Tokenizers: the built-in tiny model's byte tokenizer (264 ids); any of ``--hf`` found in the
local Hugging Face cache (offline only, skipped when absent); and a byte-level BPE trained here
on this repository's and transformers' Python sources (``--bpe-vocab`` ids, 0 to skip), a stand-in for a real
vocabulary's size when no checkpoint is cached.

Prints a table; writes ``benchmarks/results/grammar_cpu.json``.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_grammar.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from evals.report import environment, write_json  # noqa: E402
from model_executor.grammar import GrammarCache, compile_guide  # noqa: E402
from model_executor.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPECS = {
    "json_schema": {"type": "json_schema", "strict": True, "schema": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["name", "age", "color", "tags", "address"],
        "additionalProperties": False,
    }},
    "json_object": {"type": "json_object"},
    "regex": {"type": "regex", "pattern": r"[A-Z][a-z]{1,12}( [A-Z][a-z]{1,12}){0,3}, \d{4}-\d{2}-\d{2}"},
    "choice": {"type": "choice", "choices": [f"option number {i}" for i in range(64)]},
}


@dataclass(frozen=True)
class Config:
    max_tokens: int
    seed: int
    bpe_vocab: int
    hf: tuple[str, ...]


@dataclass
class Result:
    tokenizer: str
    vocab: int
    spec: str
    tokenizer_ms: float  # the tokenizer's conversion for llguidance (once per tokenizer)
    compile_ms: float  # cache miss: grammar compiled for this tokenizer
    cached_ms: float  # cache hit: a copy of the compiled matcher
    tokens: int
    terminated: bool
    mask_accept_us_median: float  # CPU time of fill_mask + accept per token
    mask_accept_us_p90: float
    mask_us_median: float  # fill_mask alone
    wall_us_median: float  # wall clock of fill_mask + accept


def _cpu_ns() -> int:
    return time.thread_time_ns()


def _bpe(vocab: int) -> HFTokenizer:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # this repository's sources and transformers' modeling code: enough text for ~32k merges
    dirs = [ROOT / d for d in ("model_executor", "kernels", "router", "serving", "tests")]
    dirs.append(Path(transformers.__file__).parent / "models")
    files = sorted(p for d in dirs for p in d.rglob("*.py"))
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator((p.read_text(errors="replace") for p in files), trainer)
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>"))


def _cached_hf(name: str) -> HFTokenizer | None:
    from transformers import AutoTokenizer

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(name, local_files_only=True))
    except (OSError, ValueError):
        return None


def tokenizers(cfg: Config) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [("byte (builtin:tiny)", ByteTokenizer())]
    for name in cfg.hf:
        tok = _cached_hf(name)
        if tok is None:
            print(f"skip {name}: not in the local Hugging Face cache", file=sys.stderr)
        else:
            out.append((name, tok))
    if cfg.bpe_vocab:
        out.append((f"bpe-{cfg.bpe_vocab} (trained here)", _bpe(cfg.bpe_vocab)))
    return out


def measure(label: str, tok, spec_name: str, cfg: Config, tokenizer_ms: float) -> Result:
    spec = SPECS[spec_name]
    cache = GrammarCache()
    cache.warm(tok)  # the tokenizer's conversion, timed by the caller
    t0 = _cpu_ns()
    guide = compile_guide(spec, tok, cache=cache)
    compile_ms = (_cpu_ns() - t0) / 1e6
    t0 = _cpu_ns()
    guide = compile_guide(spec, tok, cache=cache)
    cached_ms = (_cpu_ns() - t0) / 1e6
    gen = torch.Generator().manual_seed(cfg.seed)
    vocab = guide.vocab_size
    stops = list(guide.stop_token_ids)
    both, masks, walls = [], [], []
    for _ in range(cfg.max_tokens):
        logits = torch.randn(vocab, generator=gen) * 2
        logits[stops] += 2.0
        w0, t0 = time.perf_counter_ns(), _cpu_ns()
        guide.fill_mask(logits)
        t1, w1 = _cpu_ns(), time.perf_counter_ns()
        tok_id = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))  # not timed
        w2, t2 = time.perf_counter_ns(), _cpu_ns()
        guide.accept(tok_id)
        t3, w3 = _cpu_ns(), time.perf_counter_ns()
        masks.append((t1 - t0) / 1e3)
        both.append((t1 - t0 + t3 - t2) / 1e3)
        walls.append((w1 - w0 + w3 - w2) / 1e3)
        if guide.is_terminated():
            break
    q = statistics.quantiles(both, n=10) if len(both) > 1 else both * 9
    return Result(label, vocab, spec_name, tokenizer_ms, compile_ms, cached_ms, len(both), guide.is_terminated(),
                  statistics.median(both), q[-1], statistics.median(masks), statistics.median(walls))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bpe-vocab", type=int, default=32000)
    ap.add_argument("--hf", nargs="*", default=["meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct"])
    ap.add_argument("--out", default="grammar_cpu.json", help="a file name under benchmarks/results/, or an absolute path (written there)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = Config(args.max_tokens, args.seed, args.bpe_vocab, tuple(args.hf))
    results = []
    for label, tok in tokenizers(cfg):
        t0 = _cpu_ns()
        GrammarCache().warm(tok)
        tokenizer_ms = (_cpu_ns() - t0) / 1e6
        for spec_name in SPECS:
            results.append(measure(label, tok, spec_name, cfg, tokenizer_ms))
    head = (f"{'tokenizer':<26} {'vocab':>6} {'spec':<12} {'tok ms':>7} {'compile ms':>10} {'hit ms':>7} "
            f"{'tokens':>6} {'mask+accept us p50':>18} {'p90':>7} {'mask us':>8} {'wall us':>8}")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r.tokenizer:<26} {r.vocab:>6} {r.spec:<12} {r.tokenizer_ms:>7.1f} {r.compile_ms:>10.2f} "
              f"{r.cached_ms:>7.3f} {r.tokens:>6}{'' if r.terminated else '+'} {r.mask_accept_us_median:>17.1f} "
              f"{r.mask_accept_us_p90:>7.1f} {r.mask_us_median:>8.1f} {r.wall_us_median:>8.1f}")
    print("(+: stopped at --max-tokens before the grammar ended; times: CPU time of this thread)")
    payload = {"benchmark": "bench_grammar", "env": environment(), "config": cfg, "results": results}
    print("wrote", write_json(args.out, payload))


if __name__ == "__main__":
    main()
