"""Model-runner benchmark on the H200: TTFT and decode time per token, ours vs transformers ``sdpa``.

Model: Llama-3.1-8B's shape (32 layers, hidden 4096, 32/8 heads, d 128, MLP 14336, vocab 128256,
RoPE llama3; ``model_executor.structured_model.llama_config``), bf16, two weight sets:

- ``random``: transformers' own random init (std 0.02). Attention has no structure: random keys
  average out over a block, every block-mean score is about the same and the index keeps almost
  every block, so these rows show the operator near its
  dense limit, not a trained model's sparsity (the ``note`` field beside the numbers says so).
- ``structured``: ``model_executor.structured_model.build_structured_llama`` at the same shape (sinks,
  locality bands, retrieval heads written into the weights), prompts from ``haystack_ids``
  (needle-in-a-haystack-like): density close to the paper's on Llama-3.1-8B.

Per (model, batch B, prompt length L), B distinct prompts:

- ``ttft_ms`` (ours): page reservation (``ModelRunner.ensure_capacity``) + ``ModelRunner.prefill``
  of the B whole prompts packed into one forward (FlashPrefill V2 index + sparse attention in every
  layer, K/V written to the paged pool, LM head on each prompt's last position only) + first-token
  sampling (``Sampler``, greedy) + the token read back on the host.
- ``sdpa_ttft_ms``: the same model with ``attn_implementation="sdpa"``:
  ``model(input_ids [B, L], past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)``
  (``cache=`` on transformers versions that renamed it; a cache, so both sides keep the prompt's
  K/V) + the same sampler. With ``--sdpa-all`` off (default)
  the structured model's B > 1 rows reuse the random model's sdpa timing of the same shape from
  this run (dense sdpa does not depend on the weights; ``sdpa_source`` says which).
- ``density``: selected over causal (query head, position, key) pairs, from the index each layer
  built in the timed run (a wrapper around ``kernels.ops.build_index_planned`` keeps each layer's
  CSR entry count; no extra host sync). ``density_per_layer`` lists the layers. The entry count
  gives exact pairs because every query tile's one partially visible (diagonal) K/V tile is always
  kept; the warm-up checks this against ``evals.density`` on the real index (``warmup[].ok``).
- Decode (``decode_lengths``, default 32K and 128K, on the random model: paged decode is dense, so
  its time does not depend on the weights): ms per step (one token for each of the B requests)
  after ``decode_warmup_steps``: ours = ``ensure_capacity`` + ``ModelRunner.decode`` (Triton
  paged decode over the pool the prefill filled) + sampler; sdpa = one ``model(...)`` step on the
  ``DynamicCache`` from its prefill (which concatenates every layer's K/V each step) + sampler.

Timing: wall clock around each call with CUDA syncs. Triton kernels are compiled by a warm-up
prefill + decode at ``warmup_length`` per model. The first run at each shape is a warm-up (kernels
specialised on a size compile there: a single run at 128K once measured 0.8 s over a warm one);
then the median of up to ``max_runs`` runs when the first took under ``multi_run_below_ms`` (3 s),
else one more run.

Weight dtype (``--weight-dtype``, a column): ``bf16`` (the model dtype: bf16 on the GPU, float32 in
the CPU smoke run) and ``fp8_tensor`` / ``fp8_channel`` / ``fp8_block``: the same model (rebuilt
from its seed) with its projections quantized to e4m3 (``model_executor.fp8_linear.quantize_model``;
lm_head and embeddings stay bf16). With ``bf16`` in the same run, each FP8 row states the error of its
logits against the bf16 row's (same prompts): ``logits_vs_bf16`` (max abs, relative to max |logit|,
argmax agreement) and ``first_tokens_match_bf16``. ``memory`` holds the runner's start-up report
(weight bytes, KV pages the FP8 weights leave room for).

Memory: the KV pool is sized to the case (pages for B x (L + decode steps) tokens per layer,
``KVPoolConfig.memory_budget_bytes``). Before each case the KV + activation peak is estimated
against free memory; a case that cannot fit is skipped with the estimate in ``note``; an
OOM is caught, recorded in the row, memory freed, and the run continues. The script sets
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless already set (recorded in ``env``).

Usage (H200, ``PYTHONPATH=$PWD``): ``python3 benchmarks/bench_ttft.py`` (about 6-8 minutes);
``--quick`` (32K and 128K, B=1; about 2 minutes); ``--lengths 32768,131072 --batch 1,4 --models structured``;
``--skip-sdpa``; ``--skip-decode``; ``--sdpa-all`` (time sdpa on every model). ``--device cpu``
(implies ``--tiny``: 2-layer model, 256-1K tokens, float32; ``--quick``: 256 tokens, B=1) smoke-tests the script end to end.
Prints a table last; writes ``benchmarks/results/ttft_h200.json`` (CPU: a temp file).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

# before the first CUDA allocation: cases of 100+ GiB alternate between our pool and sdpa's cache
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from evals.report import git_commit  # noqa: E402

from evals.structured_model import (  # noqa: E402
    build_structured_llama, haystack_ids, llama31_8b_spec, llama_config, tiny_spec,
)
from kernels import ops as kernel_ops  # noqa: E402
from kernels.config import KV_TILE, Q_TILE, SparseConfig  # noqa: E402
from kv_cache import KVPool, KVPoolConfig  # noqa: E402
from model_executor import fp8_linear, fused  # noqa: E402
from model_executor.runner import ModelRunner, PrefillItem  # noqa: E402
from model_executor.sampling import Sampler, SamplingParams  # noqa: E402

GIB = 2**30
WEIGHT_DTYPES = {"bf16": None, "fp8_tensor": "tensor", "fp8_channel": "channel", "fp8_block": "block"}
RESULTS = ROOT / "benchmarks" / "results" / "ttft_h200.json"

NOTES = {
    "random": (
        "random weights (transformers init, std 0.02): random keys average out over a block, every "
        "block-mean score is about the same, and the index keeps almost every block, so this row "
        "measures the operator near its dense limit, not a trained model's sparsity (see the "
        "structured rows)"
    ),
    "structured": (
        "structured benchmark model (model_executor.structured_model at the same shape: sinks, locality, "
        "retrieval heads) on haystack_ids prompts: realistic density (paper Table 3, Llama-3.1-8B: "
        "54/34/19/9/4.6% at 8K/16K/32K/64K/128K)"
    ),
}
SDPA_MODE = (
    "transformers attn_implementation='sdpa': model(input_ids [B, L], past_key_values (or cache, "
    "transformers >= 5.2x)=DynamicCache(), use_cache=True, logits_to_keep=1) + greedy Sampler"
)
OURS_MODE = (
    "ModelRunner: ensure_capacity + prefill (B prompts packed in one forward, fpv2_paged attention, "
    "K/V into the paged pool, LM head on the last positions) + greedy Sampler"
)


@dataclasses.dataclass(frozen=True)
class TTFTBenchConfig:
    models: tuple[str, ...] = ("random", "structured")
    lengths: tuple[int, ...] = (8192, 16384, 32768, 65536, 131072)
    batches: tuple[int, ...] = (1, 4)
    decode_lengths: tuple[int, ...] = (32768, 131072)
    decode_models: tuple[str, ...] = ("random",)
    decode_warmup_steps: int = 2
    decode_steps: int = 8
    sdpa: bool = True
    sdpa_all: bool = False  # False: structured B > 1 rows reuse the random model's sdpa timing
    warmup_length: int = 8192
    multi_run_below_ms: float = 3000.0
    max_runs: int = 3
    mem_fraction: float = 0.97  # of free memory a case may plan to use
    page_size: int = 64
    dtype: str = "bfloat16"
    dense_below: int = 1024
    alpha: float = 0.1
    block_size: int = 128
    sink_tokens: int = 256
    window_tokens: int = 512
    tiny: bool = False
    device: str = "cuda"
    seed: int = 0
    backend: str = "auto"  # ModelRunner backend: "auto" (CUTLASS attention when it loads), "triton"
    kv_dtype: str = "model"  # KV pool: the model's dtype, or "fp8_e4m3" (calibrated per-layer scales)
    fused_ops: str = "auto"  # our runner's fused RMSNorm / SiLU MLP: "auto" (on CUDA), "on", "off"
    weight_dtypes: tuple[str, ...] = ("bf16",)  # WEIGHT_DTYPES: the model dtype, or FP8 projections

    @property
    def sparse_config(self) -> SparseConfig:
        return SparseConfig(alpha=self.alpha, block_size=self.block_size, sink_tokens=self.sink_tokens,
                            window_tokens=self.window_tokens)


TINY_OVERRIDES = dict(
    lengths=(512, 1024), batches=(1, 2), decode_lengths=(1024,), decode_warmup_steps=1,
    decode_steps=2, warmup_length=128, dtype="float32", dense_below=64, block_size=64,
    sink_tokens=64, window_tokens=128, max_runs=1, multi_run_below_ms=0.0, tiny=True,
)


# ---------------------------------------------------------------------------------------------
# environment, timing, memory
# ---------------------------------------------------------------------------------------------


def _env(device: torch.device, argv: list[str]) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = device.type == "cuda"
    return {
        "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
        "gpu_mem_gib": torch.cuda.get_device_properties(device).total_memory / GIB if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": "PYTHONPATH=$PWD python3 benchmarks/bench_ttft.py " + " ".join(argv),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3, out


def measure(fn, device, cfg: TTFTBenchConfig, teardown=None):
    """Run ``fn`` (after ``teardown`` of the previous result); returns (ms, runs, timing, result
    of the last run). The first run is a warm-up at this shape (a kernel specialised on a size
    compiles there: at 128K a single timed run once measured 0.8 s more than a warm one); then
    the median of up to ``max_runs`` runs, one when the first took >= ``multi_run_below_ms``.
    ``max_runs < 1``: the first run alone (the CPU smoke test)."""
    first, out = _timed(fn, device)
    runs = [first]
    if cfg.max_runs < 1:
        return first, runs, "1 run", out
    more = 1 if first >= cfg.multi_run_below_ms else max(
        1, min(cfg.max_runs, int(2 * cfg.multi_run_below_ms / max(first, 1e-3))))
    for _ in range(more):
        if teardown is not None:
            teardown(out)
        out = None
        ms, out = _timed(fn, device)
        runs.append(ms)
    return statistics.median(runs[1:]), runs, f"median of {more} runs after 1 warm run", out


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def _cleanup(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elem


def estimate_case_bytes(config, dtype, batch: int, length: int, kv_tokens: int) -> tuple[int, int]:
    """(KV bytes, activation peak bytes) of one prefill: the MLP holds act(gate), up and their
    product ([T, intermediate] each) next to the residual and normed hidden states ([T, hidden])."""
    elem = torch.empty((), dtype=dtype).element_size()
    t = batch * length
    act = t * elem * (3 * config.intermediate_size + 3 * config.hidden_size)
    return kv_bytes_per_token(config, dtype) * kv_tokens, act


# ---------------------------------------------------------------------------------------------
# density from the index each layer builds
# ---------------------------------------------------------------------------------------------


class IndexCounter:
    """Wraps ``kernels.ops.build_index_planned`` (what ``model_executor.attention`` calls in every
    layer) and keeps each call's CSR entry count as a device scalar (no host sync); with
    ``exact=True`` also ``evals.density`` of each index (host syncs: for warm-ups and CPU)."""

    def __init__(self, exact: bool = False):
        self.exact = exact
        self.nnz_dev: list[torch.Tensor] = []
        self.exact_density: list[float] = []
        self.plan = None
        self._orig = None

    def __enter__(self):
        self._orig = kernel_ops.build_index_planned
        orig = self._orig

        def wrapped(q, k_pages, v_pages, plan, **kw):
            index = orig(q, k_pages, v_pages, plan, **kw)
            self.plan = plan
            self.nnz_dev.append(index.seg_offsets[-1:])  # a view: keeps a small tensor alive
            if self.exact:
                from evals.density import density

                self.exact_density.append(float(density(index, plan)))
            return index

        kernel_ops.build_index_planned = wrapped
        return self

    def __exit__(self, *exc):
        kernel_ops.build_index_planned = self._orig
        return False

    def reset(self):
        self.nnz_dev.clear()
        self.exact_density.clear()
        self.plan = None

    def nnz(self) -> list[int]:
        if not self.nnz_dev:
            return []
        return [int(x) for x in torch.cat(self.nnz_dev).tolist()]


def density_from_nnz(plan, nnz: list[int]) -> list[float] | None:
    """Per-layer pair density from CSR entry counts, exact when every sequence has no cached
    prefix, ``L % 64 == 0`` and ``g * L % 128 == 0`` (full query tiles and K/V tiles): each query
    tile of ``128 / g`` positions has one partially visible (diagonal) K/V tile, which the index
    always keeps; every other selected tile contributes ``128 x 64`` pairs."""
    g = plan.group_size
    if Q_TILE % g:
        return None
    for lq, lkv in zip(plan.seqlens_q, plan.seqlens_kv):
        if lq != lkv or lq % KV_TILE or (g * lq) % Q_TILE:
            return None
    per_tile = Q_TILE // g
    causal = partial_tiles = partial_pairs = 0
    for length in plan.seqlens_q:
        p0 = torch.arange(g * length // Q_TILE, dtype=torch.int64) * per_tile
        pmax = p0 + per_tile - 1
        full = (p0 + 1) // KV_TILE
        part = pmax // KV_TILE + 1 - full
        pairs = g * ((pmax + 1) * (pmax + 2) // 2 - p0 * (p0 + 1) // 2)
        causal += int(pairs.sum())
        partial_tiles += int(part.sum())
        partial_pairs += int((pairs - Q_TILE * KV_TILE * full).sum())
    hkv = plan.num_kv_heads
    return [(Q_TILE * KV_TILE * (n - hkv * partial_tiles) + hkv * partial_pairs) / (hkv * causal) for n in nnz]


# ---------------------------------------------------------------------------------------------
# models and prompts
# ---------------------------------------------------------------------------------------------


def model_spec(cfg: TTFTBenchConfig):
    return tiny_spec() if cfg.tiny else llama31_8b_spec()


def build_model(kind: str, cfg: TTFTBenchConfig, device: torch.device, weight_dtype: str = "bf16"):
    """The ``kind`` model (from its seed: the same weights every call), its projections quantized
    to FP8 for an ``fp8_*`` ``weight_dtype``."""
    model = _build_model(kind, cfg, device)
    scheme = WEIGHT_DTYPES[weight_dtype]
    if scheme is not None:
        fp8_linear.quantize_model(model, scheme)
    return model


def _build_model(kind: str, cfg: TTFTBenchConfig, device: torch.device):
    dtype = getattr(torch, cfg.dtype)
    spec = model_spec(cfg)
    if kind == "structured":
        # the constructed weights come from the spec's seed, the rest of transformers' init from the
        # global RNG: seeded, so that every build (one per weight dtype) holds the same weights
        torch.manual_seed(cfg.seed)
        return build_structured_llama(spec, device=device, dtype=dtype)
    if kind != "random":
        raise ValueError(f"models: expected 'random' or 'structured', got {kind!r}")
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.manual_seed(cfg.seed)
    try:
        torch.set_default_dtype(dtype)  # initialise in the target dtype (no fp32 copy of 8B)
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(spec))
    finally:
        torch.set_default_dtype(previous)
    # no .to(dtype): the parameters are already in dtype and the RoPE inv_freq buffer stays fp32,
    # as from_pretrained leaves it
    return model.eval()


def prompts(kind: str, cfg: TTFTBenchConfig, batch: int, length: int, vocab: int) -> list[list[int]]:
    spec = model_spec(cfg)
    out = []
    for b in range(batch):
        if kind == "structured":
            ids = haystack_ids(spec, length, seed=cfg.seed + 1000 * b + length)[0]
        else:
            g = torch.Generator().manual_seed(cfg.seed + 1000 * b + length)
            ids = torch.randint(0, vocab, (length,), generator=g)
        out.append(ids.tolist())
    return out


# ---------------------------------------------------------------------------------------------
# ours: ModelRunner over a paged pool
# ---------------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1 << 30)


class Ours:
    def __init__(self, model, cfg: TTFTBenchConfig, device, batch: int, length: int, decode_steps: int):
        dtype = torch.float8_e4m3fn if cfg.kv_dtype == "fp8_e4m3" else getattr(torch, cfg.dtype)
        c = model.config
        pool_cfg0 = KVPoolConfig(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                                 head_dim=c.head_dim, page_size=cfg.page_size, dtype=dtype,
                                 device=str(device), num_pages=1)
        pages = batch * -(-(length + decode_steps + 1) // cfg.page_size)
        self.pool = KVPool(dataclasses.replace(pool_cfg0, num_pages=None,
                                               memory_budget_bytes=pages * pool_cfg0.page_bytes))
        self.runner = ModelRunner(model, self.pool, cfg.sparse_config, dense_below=cfg.dense_below,
                                  device=self.pool.k.device, backend=cfg.backend,
                                  fused_ops={"auto": None, "on": True, "off": False}[cfg.fused_ops])
        if self.pool.k_scale is not None:  # FP8 KV: the service's calibration (untimed)
            self.runner.calibrate_kv_scales()
        self.sampler = Sampler()
        self.device = device
        self.rids = [f"ttft-{b}" for b in range(batch)]
        self.tokens: list[int] = []

    @property
    def pool_gib(self) -> float:
        return self.pool.num_pages * self.pool.page_bytes / GIB

    def prefill(self, ids: list[list[int]]):
        """TTFT path: reserve, prefill, sample the first tokens (host ints)."""
        for rid, x in zip(self.rids, ids):
            self.runner.ensure_capacity(rid, len(x))
        logits = self.runner.prefill([PrefillItem(r, x, 0) for r, x in zip(self.rids, ids)])
        toks = self.sampler(logits, [GREEDY] * len(ids), [0] * len(ids)).tolist()
        self.tokens = toks
        return logits, toks

    def release(self, _=None):
        for rid in self.rids:
            self.pool.release(rid)

    def decode_step(self, step: int):
        for rid in self.rids:
            self.runner.ensure_capacity(rid, self.pool.seq_len(rid) + 1)
        logits = self.runner.decode(self.rids, self.tokens)
        self.tokens = self.sampler(logits, [GREEDY] * len(self.rids), [step] * len(self.rids)).tolist()
        return self.tokens


# ---------------------------------------------------------------------------------------------
# sdpa: transformers on the same model
# ---------------------------------------------------------------------------------------------


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the cache argument ``cache`` (``past_key_values`` deprecated)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _out_cache(out):
    for name in ("cache", "past_key_values"):
        value = out.get(name) if hasattr(out, "get") else getattr(out, name, None)
        if value is not None:
            return value
    raise RuntimeError("model output carries no cache (use_cache=True was passed)")


class Sdpa:
    def __init__(self, model, device):
        fused.uninstall(model)  # stock transformers: eager norms and MLPs, whatever our runner installed
        fp8_linear.uninstall_forwards(model)  # (an FP8 model keeps its Fp8Linear layers: its weights)
        model.set_attn_implementation("sdpa")
        self.model, self.device = model, device
        self.cache_kw = _cache_kwarg(model)
        self.sampler = Sampler()
        self.cache = None
        self.tokens: list[int] = []

    @torch.inference_mode()
    def prefill(self, ids: list[list[int]]):
        from transformers import DynamicCache

        self.cache = None
        x = torch.tensor(ids, dtype=torch.int64).to(self.device)
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self.cache_kw: DynamicCache()})
        logits = out.logits[:, -1].float()
        self.cache = _out_cache(out)
        del out
        toks = self.sampler(logits, [GREEDY] * len(ids), [0] * len(ids)).tolist()
        self.tokens = toks
        return logits, toks

    def drop(self, _=None):
        self.cache = None

    @torch.inference_mode()
    def decode_step(self, step: int):
        x = torch.tensor(self.tokens, dtype=torch.int64, device=self.device)[:, None]
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self.cache_kw: self.cache})
        self.cache = _out_cache(out)
        logits = out.logits[:, -1].float()
        del out
        self.tokens = self.sampler(logits, [GREEDY] * len(self.tokens), [step] * len(self.tokens)).tolist()
        return self.tokens


def time_decode(side, cfg: TTFTBenchConfig, device) -> dict:
    for s in range(cfg.decode_warmup_steps):
        side.decode_step(1 + s)
    steps = []
    for s in range(cfg.decode_steps):
        ms, _ = _timed(lambda: side.decode_step(1 + cfg.decode_warmup_steps + s), device)
        steps.append(ms)
    return {"ms_per_step": statistics.median(steps), "step_ms": steps}


# ---------------------------------------------------------------------------------------------
# one model: warm-up and cases
# ---------------------------------------------------------------------------------------------


def warmup(kind, model, cfg, device, counter: IndexCounter) -> dict:
    """Compile our kernels (prefill + decode) and warm sdpa at ``warmup_length``; check the
    entry-count density against ``evals.density`` on the real index."""
    length = cfg.warmup_length
    ids = prompts(kind, cfg, 1, length, model.config.vocab_size)
    t0 = time.time()
    ours = Ours(model, cfg, device, 1, length, 2)
    counter.reset()
    counter.exact = True
    try:
        ours.prefill(ids)
    finally:
        counter.exact = False
    derived = density_from_nnz(counter.plan, counter.nnz())
    exact = list(counter.exact_density)
    ours.decode_step(1)
    ours.decode_step(2)
    ours.release()
    del ours
    _cleanup(device)
    if cfg.sdpa:
        sd = Sdpa(model, device)
        sd.prefill(ids)
        sd.decode_step(1)
        sd.drop()
        del sd
        _cleanup(device)
    diff = max((abs(a - b) for a, b in zip(derived or [], exact)), default=None)
    return {"model": kind, "length": length, "seconds": time.time() - t0,
            "density_exact_per_layer": exact, "density_from_nnz_per_layer": derived,
            "max_abs_diff": diff, "ok": diff is not None and diff < 1e-9}


def run_case(kind, model, cfg, device, batch, length, counter, sdpa_cache, env, weight_dtype="bf16",
             bf16_logits=None) -> dict:
    """One (model, weight dtype, B, L) row. ``bf16_logits``: ``{(kind, B, L): (logits, first
    tokens)}`` of this run's bf16 rows; bf16 rows add theirs, FP8 rows compare with them."""
    bf16_logits = {} if bf16_logits is None else bf16_logits
    c = model.config
    dtype = getattr(torch, cfg.dtype)
    want_decode = length in cfg.decode_lengths and kind in cfg.decode_models and cfg.decode_steps > 0
    dsteps = cfg.decode_warmup_steps + cfg.decode_steps if want_decode else 0
    row: dict = {"model": kind, "weight_dtype": weight_dtype, "backend": cfg.backend, "kv_dtype": cfg.kv_dtype,
                 "fused_ops": cfg.fused_ops,
                 "batch": batch, "seqlen": length, "tokens": batch * length,
                 "status": "ok", "note": NOTES[kind], "errors": {}, "gpu": env["gpu"],
                 "commit": env["commit"], "date": env["date"]}
    t_case = time.time()
    kv, act = estimate_case_bytes(c, dtype, batch, length, batch * (length + dsteps + 1))
    row["est_kv_gib"], row["est_act_gib"] = kv / GIB, act / GIB
    free = _free_bytes(device)
    if free is not None:
        row["free_gib_before"] = free / GIB
        if kv + act > cfg.mem_fraction * free:
            row["status"] = "skipped (memory)"
            row["note"] = (f"capped: needs ~{(kv + act) / GIB:.0f} GiB (KV {kv / GIB:.0f} + activations "
                           f"{act / GIB:.0f}) with {free / GIB:.0f} GiB free after the weights; " + row["note"])
            return row
    ids = prompts(kind, cfg, batch, length, c.vocab_size)

    # ---- ours
    ours = None
    ours_logits = None
    try:
        ours = Ours(model, cfg, device, batch, length, dsteps)
        row["pool_gib"] = ours.pool_gib
        row["pool_pages"] = ours.pool.num_pages
        row["fused_counts"] = ours.runner.fused_counts
        row["fp8_counts"] = ours.runner.fp8_counts
        row["memory"] = ours.runner.memory
        t0 = time.perf_counter()
        ours.runner._check_tokens("token_ids", ids[0])
        row["host_token_check_ms"] = (time.perf_counter() - t0) * 1e3 * batch  # part of ttft_ms
        counter.reset()
        _peak_reset(device)

        def fn():
            counter.reset()
            return ours.prefill(ids)

        ms, runs, timing, out = measure(fn, device, cfg, teardown=ours.release)
        row.update(ttft_ms=ms, ttft_runs_ms=runs, timing=timing, ours_mode=OURS_MODE)
        row["peak_mem_gib"] = _peak_gib(device)
        ours_logits, row["first_tokens"] = out[0].cpu(), out[1]
        if WEIGHT_DTYPES[weight_dtype] is None:
            bf16_logits[(kind, batch, length)] = (ours_logits, list(out[1]))
        elif (kind, batch, length) in bf16_logits:
            ref_logits, ref_tokens = bf16_logits[(kind, batch, length)]
            err = fp8_linear.logits_error(ours_logits, ref_logits)
            row["logits_vs_bf16"] = err
            row["logits_rel_vs_bf16"] = err["rel"]
            row["first_tokens_match_bf16"] = sum(a == b for a, b in zip(out[1], ref_tokens)) / batch
        nnz = counter.nnz()
        dens = density_from_nnz(counter.plan, nnz) if counter.plan is not None else None
        if dens is None and counter.plan is not None:
            row["errors"]["density"] = "shape outside density_from_nnz's exact case"
        row["nnz_per_layer"] = nnz
        if dens:
            row["density"] = sum(dens) / len(dens)
            row["density_min"], row["density_max"] = min(dens), max(dens)
            row["density_per_layer"] = [round(x, 5) for x in dens]
        row["density_method"] = "CSR entries of each layer's index in the timed run (exact, see warm-up check)"
        if want_decode:
            d = time_decode(ours, cfg, device)
            row["decode_ms_per_step"], row["decode_step_ms"] = d["ms_per_step"], d["step_ms"]
            row["decode_tokens_per_s"] = batch * 1e3 / d["ms_per_step"]
            row["decode_steps"] = cfg.decode_steps
            row["decode_mode"] = "ensure_capacity + ModelRunner.decode (Triton paged decode) + greedy Sampler"
    except torch.cuda.OutOfMemoryError as e:
        row["status"] = "oom (ours)"
        row["errors"]["ours"] = repr(e)[:400]
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["status"] = "error (ours)"
        row["errors"]["ours"] = repr(e)[:400]
    finally:
        if ours is not None:
            ours.release()
        ours = None
        _cleanup(device)

    # ---- sdpa
    if not cfg.sdpa:
        return _finish(row, t_case)
    reuse = sdpa_cache.get((weight_dtype, batch, length)) if (kind != "random" and batch > 1 and not cfg.sdpa_all) else None
    if reuse is not None:
        row.update({k: v for k, v in reuse.items() if want_decode or "decode" not in k})
        row["sdpa_source"] = ("random model, same shape, this run (dense sdpa does not depend on the "
                              "weights; --sdpa-all times it here)")
        return _finish(row, t_case)
    sd = None
    try:
        sd = Sdpa(model, device)
        _peak_reset(device)
        ms, runs, timing, out = measure(lambda: sd.prefill(ids), device, cfg, teardown=sd.drop)
        sdpa_row = {"sdpa_ttft_ms": ms, "sdpa_runs_ms": runs, "sdpa_timing": timing, "sdpa_mode": SDPA_MODE,
                    "sdpa_peak_mem_gib": _peak_gib(device)}
        sd_logits, sd_tokens = out[0].cpu(), out[1]
        if ours_logits is not None:
            row["logits_max_abs_diff"] = float((ours_logits - sd_logits).abs().max())
            row["first_tokens_match"] = sum(a == b for a, b in zip(row["first_tokens"], sd_tokens)) / batch
        if want_decode:
            d = time_decode(sd, cfg, device)
            sdpa_row["sdpa_decode_ms_per_step"], sdpa_row["sdpa_decode_step_ms"] = d["ms_per_step"], d["step_ms"]
            sdpa_row["sdpa_decode_tokens_per_s"] = batch * 1e3 / d["ms_per_step"]
            sdpa_row["sdpa_decode_mode"] = ("one model() step on the DynamicCache from the prefill "
                                            "(torch.cat of every layer's K/V per step) + greedy Sampler")
        row.update(sdpa_row)
        row["sdpa_source"] = "measured (same model, same run)"
        if kind == "random":
            sdpa_cache[(weight_dtype, batch, length)] = sdpa_row
    except torch.cuda.OutOfMemoryError as e:
        row["status"] = "oom (sdpa)" if row["status"] == "ok" else row["status"] + ", oom (sdpa)"
        row["errors"]["sdpa"] = repr(e)[:400]
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["status"] = "error (sdpa)" if row["status"] == "ok" else row["status"] + ", error (sdpa)"
        row["errors"]["sdpa"] = repr(e)[:400]
    finally:
        if sd is not None:
            sd.drop()
        sd = None
        _cleanup(device)
    return _finish(row, t_case)


def _finish(row: dict, t_case: float) -> dict:
    if row.get("ttft_ms") and row.get("sdpa_ttft_ms"):
        row["speedup_vs_sdpa"] = row["sdpa_ttft_ms"] / row["ttft_ms"]
    if row.get("decode_ms_per_step") and row.get("sdpa_decode_ms_per_step"):
        row["decode_speedup_vs_sdpa"] = row["sdpa_decode_ms_per_step"] / row["decode_ms_per_step"]
    row["case_s"] = time.time() - t_case
    return row


# ---------------------------------------------------------------------------------------------
# table, arguments, main
# ---------------------------------------------------------------------------------------------

COLUMNS = [
    ("model", "model", "{}"), ("weights", "weight_dtype", "{}"), ("kv", "kv_dtype", "{}"), ("fused", "fused_ops", "{}"), ("B", "batch", "{}"), ("L", "seqlen", "{}"), ("dens", "density", "{:.3f}"),
    ("ours ms", "ttft_ms", "{:.1f}"), ("sdpa ms", "sdpa_ttft_ms", "{:.1f}"), ("x sdpa", "speedup_vs_sdpa", "{:.2f}"),
    ("dec ms", "decode_ms_per_step", "{:.2f}"), ("sdpa dec", "sdpa_decode_ms_per_step", "{:.2f}"),
    ("x dec", "decode_speedup_vs_sdpa", "{:.2f}"), ("peak GiB", "peak_mem_gib", "{:.1f}"),
    ("tok=", "first_tokens_match", "{:.2f}"), ("err bf16", "logits_rel_vs_bf16", "{:.3f}"),
    ("tok=bf16", "first_tokens_match_bf16", "{:.2f}"), ("runs", "ttft_runs_ms", "{}"), ("status", "status", "{}"),
]


def table(rows: list[dict]) -> str:
    head = [c[0] for c in COLUMNS]
    body = []
    for r in rows:
        cells = []
        for _, key, fmt in COLUMNS:
            val = r.get(key)
            if key == "ttft_runs_ms":
                val = len(val) if val else None
            if key == "sdpa_ttft_ms" and val is not None and r.get("sdpa_source", "").startswith("random"):
                cells.append(fmt.format(val) + "*")
                continue
            cells.append("-" if val is None else (val if isinstance(val, str) else fmt.format(val)))
        body.append(cells)
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _names(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def parse_args(argv=None) -> tuple[TTFTBenchConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32K and 128K at B=1 (tiny: 256 tokens, B=1)")
    ap.add_argument("--lengths", type=str, default=None, help="comma-separated prompt lengths")
    ap.add_argument("--batch", type=str, default=None, help="comma-separated batch sizes (default 1,4)")
    ap.add_argument("--models", type=str, default=None, help="random,structured (default both)")
    ap.add_argument("--decode-lengths", type=str, default=None, help="prompt lengths with decode timing")
    ap.add_argument("--decode-models", type=str, default=None, help="models with decode timing (default random)")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-sdpa", action="store_true", help="time only our runner")
    ap.add_argument("--sdpa-all", action="store_true",
                    help="time sdpa on every model (default: structured B>1 reuses the random model's)")
    ap.add_argument("--tiny", action="store_true", help="tiny model config (2 layers, hidden 512)")
    ap.add_argument("--backend", choices=("auto", "triton", "cutlass"), default="auto",
                    help="our runner's kernels (auto: the CUTLASS attention stage when its library loads)")
    ap.add_argument("--kv-dtype", choices=("model", "fp8_e4m3"), default="model",
                    help="KV pool dtype of our runner (fp8_e4m3: scales calibrated as the service does)")
    ap.add_argument("--fused-ops", choices=("auto", "on", "off"), default="auto",
                    help="our runner's fused RMSNorm and SiLU MLP kernels (auto: on CUDA; model_executor/fused.py)")
    ap.add_argument("--weight-dtype", type=str, default="bf16",
                    help=f"comma-separated weight dtypes of our runner's model, from {list(WEIGHT_DTYPES)} "
                         "(bf16: the model dtype; fp8_*: projections quantized per tensor / channel / 128x128 "
                         "block; with bf16 in the list FP8 rows report their logits' error against it)")
    ap.add_argument("--device", type=str, default="cuda", help="'cpu' smoke-tests the script (implies --tiny)")
    ap.add_argument("--out", type=str, default=None,
                    help=f"JSON path (default {RESULTS.relative_to(ROOT)}; on CPU a temp file)")
    args = ap.parse_args(argv)
    weight_dtypes = _names(args.weight_dtype)
    for w in weight_dtypes:
        if w not in WEIGHT_DTYPES:
            ap.error(f"--weight-dtype: expected names from {list(WEIGHT_DTYPES)}, got {w!r}")
    if not weight_dtypes:
        ap.error("--weight-dtype: expected at least one weight dtype")
    # bf16 first: the FP8 rows compare with its logits
    weight_dtypes = tuple(sorted(dict.fromkeys(weight_dtypes), key=lambda w: WEIGHT_DTYPES[w] is not None))
    cfg = TTFTBenchConfig(device=args.device, backend=args.backend, kv_dtype=args.kv_dtype, fused_ops=args.fused_ops,
                          weight_dtypes=weight_dtypes)
    if args.tiny or torch.device(args.device).type == "cpu":
        cfg = dataclasses.replace(cfg, **TINY_OVERRIDES)
    if args.quick:
        if cfg.tiny:
            cfg = dataclasses.replace(cfg, lengths=(256,), batches=(1,), decode_lengths=(256,))
        else:
            cfg = dataclasses.replace(cfg, lengths=(32768, 131072), batches=(1,))
    if args.lengths:
        cfg = dataclasses.replace(cfg, lengths=_ints(args.lengths))
    if args.batch:
        cfg = dataclasses.replace(cfg, batches=_ints(args.batch))
    if args.models:
        cfg = dataclasses.replace(cfg, models=_names(args.models))
    if args.decode_lengths is not None:
        cfg = dataclasses.replace(cfg, decode_lengths=_ints(args.decode_lengths))
    if args.decode_models is not None:
        cfg = dataclasses.replace(cfg, decode_models=_names(args.decode_models))
    if args.skip_decode:
        cfg = dataclasses.replace(cfg, decode_lengths=())
    if args.skip_sdpa:
        cfg = dataclasses.replace(cfg, sdpa=False)
    if args.sdpa_all:
        cfg = dataclasses.replace(cfg, sdpa_all=True)
    for m in cfg.models:
        if m not in NOTES:
            ap.error(f"--models: expected names from {sorted(NOTES)}, got {m!r}")
    return cfg, args


def resolve_device(name: str, script: str) -> torch.device:
    """``name`` as a device, a CUDA one with its index; no CUDA GPU here: exit naming ``script``."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"{script}: no CUDA GPU here; use --device cpu for the smoke test")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, args = parse_args(argv)
    device = resolve_device(cfg.device, "bench_ttft")
    if args.out:
        out_path = Path(args.out)
    elif device.type == "cuda":
        out_path = RESULTS
    else:
        out_path = Path(tempfile.gettempdir()) / "ttft_cpu_smoke.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    env = _env(device, argv)
    print(env, flush=True)
    t_start = time.time()
    rows: list[dict] = []
    config = dataclasses.asdict(cfg)
    config["sparse_config"] = dataclasses.asdict(cfg.sparse_config)
    result = {"benchmark": "TTFT and decode per token: ModelRunner (FlashPrefill V2, paged) vs transformers sdpa",
              "env": env, "config": config, "ours_mode": OURS_MODE, "sdpa_mode": SDPA_MODE,
              "notes": NOTES, "warmup": [], "rows": rows}
    sdpa_cache: dict = {}
    bf16_logits: dict = {}
    for kind in cfg.models:
        for weight_dtype in cfg.weight_dtypes:
            t0 = time.time()
            model = build_model(kind, cfg, device, weight_dtype)
            build_s = time.time() - t0
            print(f"[{kind}, {weight_dtype}] model built in {build_s:.1f} s "
                  f"({fp8_linear.weight_bytes(model)['total'] / GIB:.2f} GiB of weights)", flush=True)
            with IndexCounter() as counter:
                try:
                    w = warmup(kind, model, cfg, device, counter)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    w = {"model": kind, "error": repr(e)[:400]}
                    _cleanup(device)
                w["build_s"] = build_s
                w["weight_dtype"] = weight_dtype
                result["warmup"].append(w)
                print({k: v for k, v in w.items() if "per_layer" not in k}, flush=True)
                for batch in cfg.batches:
                    for length in cfg.lengths:
                        row = run_case(kind, model, cfg, device, batch, length, counter, sdpa_cache, env,
                                       weight_dtype, bf16_logits)
                        rows.append(row)
                        brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                                 if k not in ("note", "density_per_layer", "nnz_per_layer", "first_tokens",
                                              "decode_step_ms", "sdpa_decode_step_ms", "gpu", "commit", "date",
                                              "ours_mode", "sdpa_mode", "decode_mode", "sdpa_decode_mode", "memory")}
                        print(brief, flush=True)
                        result["wall_s"] = time.time() - t_start
                        out_path.write_text(json.dumps(result, indent=1))  # keep what we have if killed
            del model
            _cleanup(device)
    result["wall_s"] = time.time() - t_start
    out_path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out_path} ({result['wall_s']:.0f} s)")
    print("TTFT = prefill of the whole prompt + LM head on the last position + greedy first token; "
          "ours: " + OURS_MODE + "; sdpa: " + SDPA_MODE + ". dens: index density (pairs); "
          "dec ms: ms per decode step (one token per request); * sdpa timed on the random model "
          "(same shape); random-weight rows: " + NOTES["random"].split(":")[0] + " (density near 1).")
    print(table(rows))
    return result


if __name__ == "__main__":
    main()
