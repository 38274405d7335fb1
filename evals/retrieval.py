"""A hand-built needle-retrieval transformer whose two attention layers run on our operator.

Nothing is trained or downloaded: every weight is written down below, so the model retrieves
*exactly* with dense attention, and any retrieval error under sparse attention is the index
stage dropping the needle (or the correction failing to stand in for it).

Vocabulary (64 tokens, one-hot embeddings)
    ``BOS = 0``; key tokens ``1..15``; value tokens ``16..31``; filler tokens ``32..63``.
    A prompt is ``BOS``, uniform random filler, a needle ``(k v) * needle_repeats`` at a random
    depth, more filler, and the key ``k`` again as the last token. The answer is ``v``: the
    argmax of the logits at the last position over all 64 tokens.

Residual stream (width 289, named slices in :data:`LAYOUT`)
    ``tok`` one-hot token (64) | ``pos_hi`` sinusoids ``cos/sin(w_f p)`` at 32 high frequencies
    ``w_f`` in ``[0.5, 2.9]`` rad/token (64) | ``pos_lo`` sinusoids at 16 low frequencies,
    wavelengths 256..8192 tokens (32) | ``one`` a constant 1 (1) | ``prev`` written by layer 1
    (64) | ``out`` written by layer 2 and read by the unembedding (64).

Layer 1, previous-token head (KV head 0, query heads 0..g-1)
    ``q = c1 * R(-w) pos_hi(p)`` (each sin/cos pair rotated back by one token: a linear map),
    ``k = pos_hi(j)``, ``v = tok(j)``; the logit is ``c1 * sum_f cos(w_f (p - 1 - j))``: 32 * c1
    at ``j = p - 1`` and at most ~16.5 * c1 elsewhere for every distance up to 128K (the
    frequencies are fixed, the tail bound is checked in the tests), so with ``c1 = 2`` the
    softmax is one-hot to ~1e-14 and ``prev(p) = tok(p - 1)``. The output projection writes
    the mean of the group's heads into ``prev``.

Layer 2, induction head (KV head 0)
    ``q = [match * tok_keys(p), loc/16 * pos_lo(p), sink * one]``,
    ``k = [prev_keys(j), pos_lo(j), tok_bos(j)]``, ``v = tok(j)`` with the BOS and key rows
    zeroed. The logit of key ``j`` for the query at ``p`` is
    ``match * [prev(j) == tok(p) is a key token] + loc * locality(p - j) + sink * [j == 0]``
    with ``locality(d) = mean_f cos(2 pi d / W_f)`` (1 at d = 0, decaying within a few hundred
    tokens, then fluctuating around 0 with an amplitude below ~0.6). At the last token (the key
    ``k``) the only match is the position right after each ``k`` in the needle, which holds
    ``v``; the output projection writes the attended values into ``out``, so the logits are
    the attention mass per token and the argmax is ``v`` as soon as the match logit beats the
    log of the filler mass (``match = 16`` vs ``log(L / 32 * ~1.2) < 9`` at 128K).

KV head 1 of both layers (query heads g..2g-1)
    A local + sink head (``loc * locality + sink * [j == 0]``) with zero output: it gives the
    operator a second KV head with a different selection pattern and does not touch the answer.

Why sparse attention can lose the needle
    The index scores blocks with mean keys, summed over a 128-row query tile. In layer 2's last
    tile only the ``g`` rows of the final token match, and a single matching key adds
    ``match / block_size`` to its block's mean logit, while the window blocks carry the full
    locality bonus ``loc``. A single-token needle therefore passes the ``alpha`` threshold only
    when it lies in the sink, the window, or where ``locality`` happens to be high; mean
    correction cannot recover it (the pruned block contributes ``e^{match/Bs} v_bar``, a few
    units of mass, against thousands of filler units). ``needle_repeats`` puts the pair ``n``
    times in a row: the block-mean logit grows to ``n * match / Bs`` and the needle survives
    selection once ``g / 128 * e^{n * match / Bs}`` clears ``alpha * e^{loc}``, unless the needle
    straddles a block boundary and splits its evidence.

All logits assume the operator's softmax scale: queries are multiplied by
``1 / config.softmax_scale(head_dim)``. fp32 on CPU (reference backend), bf16 on GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import ops, reference
from kernels.config import KV_TILE, SparseConfig
from kernels.index import SparseIndex
from kernels.paged import contiguous_to_paged
from kernels.plan import PrefillPlan

from .density import density as index_density

BOS = 0
KEY_TOKENS = range(1, 16)
VALUE_TOKENS = range(16, 32)
FILLER_TOKENS = range(32, 64)
VOCAB_SIZE = 64

NUM_HI_FREQS = 32
NUM_LO_FREQS = 16
_HI_FREQ_SEED = 2  # fixed: its tail bound (max_{d>=2} sum_f cos(w_f d) ~ 15.7 of 32) is tested
LO_WAVELENGTHS = (256.0, 8192.0)


def _layout() -> dict[str, slice]:
    widths = [("tok", VOCAB_SIZE), ("pos_hi", 2 * NUM_HI_FREQS), ("pos_lo", 2 * NUM_LO_FREQS),
              ("one", 1), ("prev", VOCAB_SIZE), ("out", VOCAB_SIZE)]
    layout, at = {}, 0
    for name, w in widths:
        layout[name] = slice(at, at + w)
        at += w
    return layout


LAYOUT = _layout()
D_MODEL = LAYOUT["out"].stop


def hi_frequencies() -> torch.Tensor:
    g = torch.Generator().manual_seed(_HI_FREQ_SEED)
    return 0.5 + 2.4 * torch.rand(NUM_HI_FREQS, generator=g, dtype=torch.float64)


def lo_frequencies() -> torch.Tensor:
    lo, hi = LO_WAVELENGTHS
    wavelengths = torch.logspace(math.log10(lo), math.log10(hi), NUM_LO_FREQS, dtype=torch.float64)
    return 2 * math.pi / wavelengths


def locality(distance: torch.Tensor) -> torch.Tensor:
    """``mean_f cos(w_f d)`` over the low frequencies: layer 2's recency profile."""
    return torch.cos(distance.double()[..., None] * lo_frequencies()).mean(-1)


def _sinusoids(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``[L, 2F]``: cos then sin of each frequency, angles reduced mod 2 pi in float64."""
    ang = torch.remainder(positions.double()[:, None] * freqs[None, :], 2 * math.pi)
    return torch.stack([ang.cos(), ang.sin()], -1).reshape(len(positions), -1)


@dataclass(frozen=True)
class NeedleModelConfig:
    """The few numbers of the construction (logits in natural-log units)."""

    head_dim: int = 64
    num_qo_heads: int = 4
    num_kv_heads: int = 2
    prev_logit: float = 2.0  # per high frequency: 64 at the previous token
    match_logit: float = 16.0  # induction match, per matching key
    locality_logit: float = 3.0  # recency bonus at distance 0 (layer 2 and the local heads)
    sink_logit: float = 8.0  # every query's logit on BOS

    def __post_init__(self) -> None:
        if self.num_kv_heads != 2 or self.num_qo_heads % 2:
            raise ValueError(
                f"num_qo_heads/num_kv_heads: expected 2 KV heads and an even number of query heads, "
                f"got {self.num_qo_heads}/{self.num_kv_heads}"
            )
        if self.head_dim < 64:
            raise ValueError(f"head_dim: expected >= 64 (one-hot tokens need 64), got {self.head_dim}")


@dataclass
class NeedleBatch:
    ids: torch.Tensor  # [B, L] int64
    answers: torch.Tensor  # [B] value token
    value_positions: torch.Tensor  # [B, n] positions holding the value token in the needle


@dataclass
class LayerTrace:
    plan: PrefillPlan
    index: SparseIndex


@dataclass
class NeedleOutput:
    logits: torch.Tensor  # [B, VOCAB_SIZE] float32 at the last position
    traces: list[LayerTrace]

    @property
    def predictions(self) -> torch.Tensor:
        return self.logits.argmax(-1)


def make_needle_batch(
    length: int, batch: int, *, seed: int, needle_repeats: int = 1,
    depths: torch.Tensor | None = None, device: torch.device | str = "cpu",
) -> NeedleBatch:
    """Random prompts; ``depths`` in [0, 1] (per prompt) pins where the needle starts."""
    n = needle_repeats
    if length < 2 * n + 3:
        raise ValueError(f"length: expected >= {2 * n + 3} for needle_repeats={n}, got {length}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(FILLER_TOKENS.start, FILLER_TOKENS.stop, (batch, length), generator=g)
    ids[:, 0] = BOS
    keys = torch.randint(KEY_TOKENS.start, KEY_TOKENS.stop, (batch,), generator=g)
    values = torch.randint(VALUE_TOKENS.start, VALUE_TOKENS.stop, (batch,), generator=g)
    span = length - 2 - 2 * n  # needle starts in [1, span]
    if depths is None:
        starts = torch.randint(1, span + 1, (batch,), generator=g)
    else:
        starts = 1 + torch.round(depths.double().clamp(0, 1) * (span - 1)).long()
    offs = torch.arange(n)
    rows = torch.arange(batch)[:, None]
    key_pos = starts[:, None] + 2 * offs[None, :]
    ids[rows, key_pos] = keys[:, None]
    ids[rows, key_pos + 1] = values[:, None]
    ids[:, -1] = keys
    return NeedleBatch(ids.to(device), values.to(device), (key_pos + 1).to(device))


class NeedleRetrievalModel:
    """Two attention-only layers (no MLPs, no norms) with hand-set weights; see the module doc."""

    def __init__(self, config: NeedleModelConfig | None = None, *, device="cpu", dtype=torch.float32):
        self.config = cfg = config or NeedleModelConfig()
        self.device, self.dtype = torch.device(device), dtype
        d, hq, g = cfg.head_dim, cfg.num_qo_heads, cfg.num_qo_heads // cfg.num_kv_heads
        L = LAYOUT
        self.wq = [torch.zeros(D_MODEL, hq, d, dtype=torch.float64) for _ in range(2)]
        self.wk = [torch.zeros(D_MODEL, 2, d, dtype=torch.float64) for _ in range(2)]
        self.wv = [torch.zeros(D_MODEL, 2, d, dtype=torch.float64) for _ in range(2)]
        self.wo = [torch.zeros(hq, d, D_MODEL, dtype=torch.float64) for _ in range(2)]
        eye = torch.eye(VOCAB_SIZE, dtype=torch.float64)

        # Layer 1, KV head 0: previous-token head.
        w = hi_frequencies()
        c, s = torch.cos(w), torch.sin(w)
        hi0 = L["pos_hi"].start
        for f in range(NUM_HI_FREQS):
            ci, si = hi0 + 2 * f, hi0 + 2 * f + 1  # rows: residual (cos, sin); cols: head dims
            for h in range(g):
                # [cos a, sin a] -> [cos(a - w), sin(a - w)]
                self.wq[0][ci, h, 2 * f] = cfg.prev_logit * c[f]
                self.wq[0][si, h, 2 * f] = cfg.prev_logit * s[f]
                self.wq[0][ci, h, 2 * f + 1] = -cfg.prev_logit * s[f]
                self.wq[0][si, h, 2 * f + 1] = cfg.prev_logit * c[f]
            self.wk[0][ci, 0, 2 * f] = 1.0
            self.wk[0][si, 0, 2 * f + 1] = 1.0
        self.wv[0][L["tok"], 0, :VOCAB_SIZE] = eye
        for h in range(g):
            self.wo[0][h, :VOCAB_SIZE, L["prev"]] = eye / g

        # Layer 2, KV head 0: induction head.
        nk = len(KEY_TOKENS)
        lo = L["pos_lo"]
        for h in range(g):
            for i, t in enumerate(KEY_TOKENS):
                self.wq[1][L["tok"].start + t, h, i] = cfg.match_logit
            self.wq[1][lo, h, nk : nk + lo.stop - lo.start] = torch.eye(lo.stop - lo.start, dtype=torch.float64) * (cfg.locality_logit / NUM_LO_FREQS)
            self.wq[1][L["one"].start, h, nk + 2 * NUM_LO_FREQS] = cfg.sink_logit
        for i, t in enumerate(KEY_TOKENS):
            self.wk[1][L["prev"].start + t, 0, i] = 1.0
        self.wk[1][lo, 0, nk : nk + lo.stop - lo.start] = torch.eye(lo.stop - lo.start, dtype=torch.float64)
        self.wk[1][L["tok"].start + BOS, 0, nk + 2 * NUM_LO_FREQS] = 1.0
        value_eye = eye.clone()
        value_eye[BOS, BOS] = 0.0
        for t in KEY_TOKENS:
            value_eye[t, t] = 0.0
        self.wv[1][L["tok"], 0, :VOCAB_SIZE] = value_eye
        for h in range(g):
            self.wo[1][h, :VOCAB_SIZE, L["out"]] = eye / g

        # KV head 1 of both layers: local + sink head, zero value and output.
        for layer in range(2):
            for h in range(g, 2 * g):
                self.wq[layer][lo, h, : lo.stop - lo.start] = torch.eye(lo.stop - lo.start, dtype=torch.float64) * (cfg.locality_logit / NUM_LO_FREQS)
                self.wq[layer][L["one"].start, h, 2 * NUM_LO_FREQS] = cfg.sink_logit
            self.wk[layer][lo, 1, : lo.stop - lo.start] = torch.eye(lo.stop - lo.start, dtype=torch.float64)
            self.wk[layer][L["tok"].start + BOS, 1, 2 * NUM_LO_FREQS] = 1.0

        cast = dict(device=self.device, dtype=self.dtype)
        self.wq = [x.reshape(D_MODEL, -1).to(**cast) for x in self.wq]
        self.wk = [x.reshape(D_MODEL, -1).to(**cast) for x in self.wk]
        self.wv = [x.reshape(D_MODEL, -1).to(**cast) for x in self.wv]
        self.wo = [x.reshape(-1, D_MODEL).to(**cast) for x in self.wo]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``[B, L, D_MODEL]``: one-hot token + sinusoids + the constant feature."""
        bsz, length = ids.shape
        x = torch.zeros(bsz, length, D_MODEL, device=self.device, dtype=self.dtype)
        x[..., LAYOUT["tok"]] = torch.nn.functional.one_hot(ids.to(self.device), VOCAB_SIZE).to(self.dtype)
        pos = torch.arange(length)
        x[..., LAYOUT["pos_hi"]] = _sinusoids(pos, hi_frequencies()).to(self.device, self.dtype)
        x[..., LAYOUT["pos_lo"]] = _sinusoids(pos, lo_frequencies()).to(self.device, self.dtype)
        x[..., LAYOUT["one"]] = 1.0
        return x

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: SparseConfig, backend: str,
    ) -> tuple[torch.Tensor, LayerTrace]:
        """Our operator on contiguous ``[B, L, H, d]`` inputs, keeping the plan and index.

        ``backend="torch-dense"`` replaces the attention stage by
        ``kernels.reference.dense_attention`` (an independent dense path for tests).
        """
        bsz, length, hq, d = q.shape
        k_pages, page_table = contiguous_to_paged(k.contiguous(), KV_TILE)
        v_pages, _ = contiguous_to_paged(v.contiguous(), KV_TILE)
        cu = torch.arange(0, (bsz + 1) * length, length, dtype=torch.int32, device=q.device)
        seqlens_kv = torch.full((bsz,), length, dtype=torch.int32, device=q.device)
        qf = q.reshape(bsz * length, hq, d).contiguous()
        plan = ops.plan_prefill(qf, k_pages, v_pages, page_table, cu, seqlens_kv, config)
        op_backend = "reference" if backend == "torch-dense" else backend
        index = ops.build_index_planned(qf, k_pages, v_pages, plan, backend=op_backend)
        if backend == "torch-dense":
            out, _ = reference.dense_attention(qf, k_pages, v_pages, plan)
        else:
            out, _ = ops.attention_planned(qf, k_pages, v_pages, plan, index, backend=op_backend)
        return out.reshape(bsz, length, hq, d), LayerTrace(plan, index)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, config: SparseConfig, *, backend: str = "auto") -> NeedleOutput:
        cfg = self.config
        d, hq = cfg.head_dim, cfg.num_qo_heads
        bsz, length = ids.shape
        q_gain = 1.0 / config.softmax_scale(d)
        x = self.embed(ids)
        traces = []
        for layer in range(2):
            q = (x @ self.wq[layer]).reshape(bsz, length, hq, d) * q_gain
            k = (x @ self.wk[layer]).reshape(bsz, length, 2, d)
            v = (x @ self.wv[layer]).reshape(bsz, length, 2, d)
            out, trace = self._attend(q, k, v, config, backend)
            traces.append(trace)
            x = x + out.reshape(bsz, length, hq * d) @ self.wo[layer]
        logits = x[:, -1, LAYOUT["out"]].float()
        return NeedleOutput(logits, traces)

    __call__ = forward


def needle_selected(trace: LayerTrace, value_positions: torch.Tensor) -> torch.Tensor:
    """Bool ``[B]``: KV head 0's last query tile selected every 64-token tile holding a value.

    (Tiles, not blocks: the CSR drops tiles past a row's causal horizon, never a needle's.)
    """
    plan, index = trace.plan, trace.index
    offsets = index.seg_offsets.tolist()
    hits = []
    for b in range(plan.batch_size):
        seg = plan.cu_qtiles_host[b + 1] - 1  # KV head 0: seg = 0 * total_tiles + tile
        tiles = index.kv_tiles[offsets[seg] : offsets[seg + 1]].long()
        need = torch.unique(value_positions[b].long() // KV_TILE).to(tiles.device)
        hits.append(bool(torch.isin(need, tiles).all()))
    return torch.tensor(hits)


@dataclass
class TrialResult:
    variant: str
    length: int
    trials: int
    correct: int
    needle_selected: int
    density_layer2: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials if self.trials else 0.0


def run_trials(
    model: NeedleRetrievalModel, length: int, trials: int, variants: dict[str, SparseConfig], *,
    seed: int = 0, needle_repeats: int = 1, batch_size: int = 8, backend: str = "auto",
) -> list[TrialResult]:
    """Accuracy of each variant on the same ``trials`` prompts (seeded per batch)."""
    results = {name: TrialResult(name, length, 0, 0, 0, 0.0) for name in variants}
    for start in range(0, trials, batch_size):
        nb = min(batch_size, trials - start)
        batch = make_needle_batch(length, nb, seed=seed * 1_000_003 + start, needle_repeats=needle_repeats,
                                  device=model.device)
        for name, config in variants.items():
            out = model(batch.ids, config, backend=backend)
            r = results[name]
            r.trials += nb
            r.correct += int((out.predictions == batch.answers).sum())
            r.needle_selected += int(needle_selected(out.traces[1], batch.value_positions.cpu()).sum())
            r.density_layer2 += index_density(out.traces[1].index, out.traces[1].plan) * nb
    for r in results.values():
        r.density_layer2 /= max(r.trials, 1)
    return list(results.values())


__all__ = [
    "BOS", "KEY_TOKENS", "VALUE_TOKENS", "FILLER_TOKENS", "VOCAB_SIZE", "LAYOUT", "D_MODEL",
    "NeedleModelConfig", "NeedleRetrievalModel", "NeedleBatch", "NeedleOutput", "LayerTrace",
    "TrialResult", "make_needle_batch", "needle_selected", "run_trials", "locality",
    "hi_frequencies", "lo_frequencies",
]
