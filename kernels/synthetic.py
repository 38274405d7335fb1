"""Structured synthetic Q/K/V for the operator benchmarks, tests and demo.

Random Gaussian Q/K give flat attention: the index stage then keeps almost nothing or almost
everything, and neither says much about a block-sparse kernel. These inputs carry the structure
that real long-context models show, with the index stage's density (default ``SparseConfig``)
calibrated to a target, by default the paper's needle-in-a-haystack densities
(``paper_density``).

Planted per KV head (the ``g`` query heads of a group share it; every sequence of a batch
shares the pattern, not the noise):
- *Sink*: the first key block aligns with every query (block-mean logit ``H``), its first token
  most of all (the BOS spike).
- *Local band*: q and k share a slowly drifting random direction ``r(pos)`` (Gaussian-smoothed
  noise, correlation length ~10 tokens), so keys near a query score higher.
- *Vertical stripes*: key blocks that every later query attends to. Their number is the
  calibration knob (below).
- *Slash diagonals* (odd KV heads, ``head_dim >= 64``): query block ``P`` attends to key blocks
  ``P - delta - m * N`` (``m = 0, 1, ...``) through a one-hot block code modulo ``N = d / 2``
  (at most 64).
- *Needles*: a few remote key blocks aligned with the queries of up to four later query blocks
  only; their positions are returned (``StructuredInputs.needle_blocks``) for recall metrics.
- *Background*: every other key block has block-mean logit 0. Token-level content noise and the
  local band's cross-talk spread token logits by about one nat around that, and values carry a
  per-block offset, so pruned blocks hold real mass and information (what mean correction has
  to recover).

Why the density is predictable. Everything except the salient components is exactly zero-mean
inside each key block, so the block means ``kbar_J`` that the index scores see only the planted
structure: salient blocks at ``H +- 0.4`` nats (needles ``H + 0.4``), the sink block at ``H``
(visible to every tile, so a tile's maximum is always in ``[H, H + 0.4]``), the rest at 0. With
``H = 6`` and ``alpha = 0.1`` (threshold 2.3 nats under the maximum) a salient block passes
with >= 1.5 nats to spare and a background block fails by >= 3.7 nats: the index selects
exactly "forced (sink, window, diagonal) union planted salient blocks", for any alpha in about
[0.02, 0.3]. No block carries two salient components (their logits would add).

Calibration rule (analytic; no measured table). From the planted pattern and the config's
forced-block rules the generator computes, per (KV head, query tile), the blocks the index will
select, hence the density as a function of the number ``n`` of stripe blocks per head (each head
adds its stripes in a fixed random order, so the density is a cumulative sum along that order).
It takes the ``n`` whose density is closest to the target. Targets below the floor
(forced + slash + needles: about 2.0% at 128K and 1.4% at 256K for 32/8 heads, d=128) or above
what every block gives are clamped; ``predicted_density`` reports what the pattern gives. The prediction is exact
when ``g`` divides 128 (query tiles never straddle a key block), e.g. 32/8 heads; with other
ratios it is approximate. ``tests/test_synthetic.py`` checks it against the reference index.

Randomness: the pattern (positions, offsets, rotations) comes from a CPU generator, so it is
the same on every device; token-level noise comes from a generator on ``device``: tensors are
deterministic per (seed, device). Generation is vectorised (a few GB of fp32 temporaries at
128K x 32 heads x d=128 on a GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import Q_TILE, SparseConfig

# Block-mean logit of salient blocks over the background (nats), and their per-block jitter.
SALIENT_LOGIT = 6.0
SALIENT_JITTER = 0.4
# Needles are the strongest blocks of the tiles that look for them.
NEEDLE_BOOST = 0.4
# The first token's extra logit over the rest of the sink block.
BOS_BOOST = 2.5
# Token-level logit spread inside salient blocks (zero block mean), nats.
TOKEN_SPREAD = 1.0
# Token-level content logit noise (zero block mean on the key side), nats.
CONTENT_LOGIT_STD = 0.6
# Local band cross-talk between unrelated tokens (nats); the band's peak is this * sqrt(dims).
LOCAL_CROSSTALK = 0.8
# Gaussian smoothing (tokens) of the local band's drifting direction.
LOCAL_SMOOTHING = 6.0
# Per-block value offset (std) on top of unit token noise.
VALUE_BLOCK_STD = 0.5
# A needle's query range spans up to this many key blocks.
NEEDLE_QUERY_BLOCKS = 4

# Paper Table 3 (Llama-3.1-8B, alpha = 0.1, block 128): density on needle-in-a-haystack inputs.
PAPER_DENSITY = ((4096, 0.760), (8192, 0.542), (16384, 0.336), (32768, 0.187),
                 (65536, 0.090), (131072, 0.046))

# What a key block carries (per KV head).
_NONE, _SINK, _STRIPE, _NEEDLE, _SLASH = 0, 1, 2, 3, 4


def paper_density(seqlen: int) -> float:
    """The paper's needle-in-a-haystack density at ``seqlen`` (Table 3, Llama-3.1-8B row).

    Linear in (log length, log density) between the measured lengths 4K..128K, continued with
    the end segments' slopes beyond them, and at most 1.
    """
    if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < 1:
        raise ValueError(f"seqlen: expected a positive int, got {seqlen!r}")
    xs = [math.log(n) for n, _ in PAPER_DENSITY]
    ys = [math.log(d) for _, d in PAPER_DENSITY]
    x = math.log(seqlen)
    i = max([0] + [j for j in range(len(xs) - 1) if xs[j] <= x])
    i = min(i, len(xs) - 2)
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return min(1.0, math.exp(ys[i] + slope * (x - xs[i])))


@dataclass(frozen=True)
class StructuredInputs:
    """Structured q/k/v and the pattern planted in them.

    q ``[B, L, Hq, d]``, k and v ``[B, L, Hkv, d]``.
    needle_blocks: int64 ``[N, 6]`` on the CPU, one row per planted needle and sequence:
        ``(batch, kv_head, key_start, key_end, query_start, query_end)`` in token positions,
        ends exclusive: the queries in ``[query_start, query_end)`` look for the keys in
        ``[key_start, key_end)``.
    stripe_blocks: per KV head, the key blocks (``config.block_size`` tokens) planted as stripes.
    slash_offsets: per KV head, the slash offset in blocks (None: no slash in that head).
    target_density: what was asked; predicted_density: what the pattern gives with ``config``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    needle_blocks: torch.Tensor
    stripe_blocks: tuple[tuple[int, ...], ...]
    slash_offsets: tuple[int | None, ...]
    target_density: float
    predicted_density: float
    config: SparseConfig

    @property
    def num_stripes(self) -> int:
        """Stripe blocks per KV head (the calibrated knob)."""
        return len(self.stripe_blocks[0]) if self.stripe_blocks else 0


def structured_qkv(
    seqlen: int,
    *,
    batch: int = 1,
    num_qo_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    target_density: float | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [B, L, Hq, d], k [B, L, Hkv, d], v [B, L, Hkv, d])`` with the structure described in
    this module, calibrated so that the default ``SparseConfig`` index selects about
    ``target_density`` (``None``: ``paper_density(seqlen)``). See ``structured_inputs``."""
    x = structured_inputs(
        seqlen, batch=batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, target_density=target_density, dtype=dtype, device=device, seed=seed,
    )
    return x.q, x.k, x.v


def structured_inputs(
    seqlen: int,
    *,
    batch: int = 1,
    num_qo_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    target_density: float | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    seed: int = 0,
    config: SparseConfig | None = None,
) -> StructuredInputs:
    """Structured inputs plus the planted pattern (needles, stripes) and the predicted density.

    ``config`` (default ``SparseConfig()``) is the index configuration the density is calibrated
    for: its block size, sink and window; alpha does not matter (see the module docstring).
    """
    _check_args(seqlen, batch, num_qo_heads, num_kv_heads, head_dim, target_density, dtype, seed)
    cfg = SparseConfig() if config is None else config
    if not isinstance(cfg, SparseConfig):
        raise ValueError(f"config: expected a SparseConfig or None, got {type(cfg).__name__}")
    device = _check_device(device)
    target = paper_density(seqlen) if target_density is None else float(target_density)
    group = num_qo_heads // num_kv_heads
    layout = _Layout.for_head_dim(head_dim)
    gen = torch.Generator().manual_seed(seed)
    pattern, candidates, jitter = _draw_pattern(seqlen, num_kv_heads, layout, cfg, gen)
    stripes, predicted = _calibrate(seqlen, group, pattern, candidates, cfg, target)
    for h, blocks in enumerate(stripes):
        pattern.kind[h, blocks] = _STRIPE
        pattern.coord[h, blocks] = layout.stripe
        pattern.level[h, blocks] = SALIENT_LOGIT + jitter[h, blocks]
    noise = torch.Generator(device=device).manual_seed(seed)
    q, k, v = _materialise(seqlen, batch, num_kv_heads, group, layout, pattern, cfg, device, noise)
    bs = cfg.block_size
    rows = []
    for h in range(num_kv_heads):
        for key_block, qb0, qb1 in pattern.needles[h].tolist():
            if qb1 > qb0:
                rows += [[b, h, key_block * bs, min((key_block + 1) * bs, seqlen), qb0 * bs,
                          min(qb1 * bs, seqlen)] for b in range(batch)]
    needle_blocks = torch.tensor(rows, dtype=torch.int64).reshape(-1, 6)
    return StructuredInputs(
        q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), needle_blocks=needle_blocks,
        stripe_blocks=tuple(tuple(sorted(s.tolist())) for s in stripes),
        slash_offsets=pattern.slash_delta, target_density=target, predicted_density=predicted,
        config=cfg,
    )


# ---------------------------------------------------------------------------------------------
# Validation


def _check_args(seqlen, batch, num_qo_heads, num_kv_heads, head_dim, target_density, dtype, seed):
    for name, value, low in (("seqlen", seqlen, 1), ("batch", batch, 1),
                             ("num_qo_heads", num_qo_heads, 1), ("num_kv_heads", num_kv_heads, 1),
                             ("head_dim", head_dim, 16), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads: expected a multiple of num_kv_heads ({num_kv_heads}), got {num_qo_heads}"
        )
    if head_dim % 16 or head_dim > 256:
        raise ValueError(f"head_dim: expected a multiple of 16 in [16, 256], got {head_dim}")
    if target_density is not None and (
        isinstance(target_density, bool) or not isinstance(target_density, (int, float))
        or not 0.0 < float(target_density) <= 1.0
    ):
        raise ValueError(f"target_density: expected a float in (0, 1] or None, got {target_density!r}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: expected torch.float16, bfloat16 or float32, got {dtype!r}")


def _check_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected a torch device such as 'cuda' or 'cpu', got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but CUDA is not available; pass device='cpu'")
    return dev


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# The block-level pattern (host)


@dataclass(frozen=True)
class _Layout:
    """Which coordinates (before each head's random rotation) carry which component:
    ``[sink, stripe, needles..., slash code..., local band..., content...]``."""

    head_dim: int
    needles: int
    slash: int
    local: int

    sink = 0
    stripe = 1
    needle0 = 2

    @property
    def slash0(self) -> int:
        return self.needle0 + self.needles

    @property
    def local0(self) -> int:
        return self.slash0 + self.slash

    @property
    def content0(self) -> int:
        return self.local0 + self.local

    @classmethod
    def for_head_dim(cls, d: int) -> "_Layout":
        # One coordinate per slash residue: N = d/2 (at most 64) keeps the slash blocks per tile
        # (about L / (128 N)) within the paper's 128K budget.
        slash = min(d // 2, 64) if d >= 64 else 0
        return cls(head_dim=d, needles=4 if d >= 64 else 2, slash=slash, local=min(d // 4, 32))


@dataclass(frozen=True)
class _Pattern:
    """Per (KV head, key block): the component, its coordinate and its block-mean logit."""

    kind: torch.Tensor  # int64 [Hkv, nb]
    coord: torch.Tensor  # int64 [Hkv, nb]
    level: torch.Tensor  # float32 [Hkv, nb]
    needles: torch.Tensor  # int64 [Hkv, n, 3]: key block, first query block, end query block
    slash_delta: tuple[int | None, ...]
    slash_mod: int
    rotation: torch.Tensor  # float32 [Hkv, d, d], orthogonal


def _draw_pattern(
    seqlen: int, num_kv_heads: int, layout: _Layout, cfg: SparseConfig, gen: torch.Generator
) -> tuple[_Pattern, list[torch.Tensor], torch.Tensor]:
    """Sink, needles and slash; the stripe candidates of each head in a random order."""
    bs = cfg.block_size
    nb = _cdiv(seqlen, bs)
    sink_blocks = min(_cdiv(cfg.sink_tokens, bs), nb)
    gap = _cdiv(cfg.window_tokens, bs) + 2  # a needle lies beyond the window of its queries
    kind = torch.zeros(num_kv_heads, nb, dtype=torch.int64)
    coord = torch.zeros(num_kv_heads, nb, dtype=torch.int64)
    level = torch.zeros(num_kv_heads, nb)
    kind[:, 0], coord[:, 0], level[:, 0] = _SINK, layout.sink, SALIENT_LOGIT
    needles = torch.zeros(num_kv_heads, layout.needles, 3, dtype=torch.int64)
    jitter = (torch.rand(num_kv_heads, nb, generator=gen) * 2 - 1) * SALIENT_JITTER
    blocks = torch.arange(nb)
    slash_delta: list[int | None] = []
    candidates = []
    for h in range(num_kv_heads):
        # Needles: a key block, then 1..4 complete query blocks at least `gap` blocks later.
        last_query_block = seqlen // bs  # blocks [.., last_query_block) are complete
        hi = last_query_block - gap
        if hi > sink_blocks:
            picks = torch.randperm(hi - sink_blocks, generator=gen)[: layout.needles] + sink_blocks
            for i, key_block in enumerate(picks.tolist()):
                span = last_query_block - key_block - gap
                qb0 = key_block + gap + int(torch.randint(0, span, (1,), generator=gen))
                qb1 = min(last_query_block, qb0 + NEEDLE_QUERY_BLOCKS)
                needles[h, i] = torch.tensor([key_block, qb0, qb1])
                kind[h, key_block] = _NEEDLE
                coord[h, key_block] = layout.needle0 + i
                level[h, key_block] = SALIENT_LOGIT + NEEDLE_BOOST
        # Slash (odd heads): every free block past the sinks carries the code of block J + delta.
        if layout.slash > gap and h % 2 == 1:
            delta = gap + int(torch.randint(0, layout.slash - gap, (1,), generator=gen))
            free = (kind[h] == _NONE) & (blocks >= sink_blocks)
            kind[h, free] = _SLASH
            coord[h, free] = layout.slash0 + (blocks[free] + delta) % layout.slash
            level[h, free] = SALIENT_LOGIT + jitter[h, free]
            slash_delta.append(delta)
        else:
            slash_delta.append(None)
        # Stripe candidates: blocks past the sinks that are not needles (a stripe replaces the
        # slash code of its block: it is salient for every tile anyway).
        cand = blocks[sink_blocks:]
        cand = cand[kind[h, cand] != _NEEDLE]
        candidates.append(cand[torch.randperm(len(cand), generator=gen)])
    d = layout.head_dim
    rotation = torch.linalg.qr(torch.randn(num_kv_heads, d, d, generator=gen))[0]
    pattern = _Pattern(kind, coord, level, needles, tuple(slash_delta), max(layout.slash, 1), rotation)
    return pattern, candidates, jitter


# ---------------------------------------------------------------------------------------------
# Calibration: the density the index will give, from the pattern


def _calibrate(
    seqlen: int, group: int, pattern: _Pattern, candidates: list[torch.Tensor],
    cfg: SparseConfig, target: float,
) -> tuple[list[torch.Tensor], float]:
    """Stripe blocks per head (a prefix of each head's candidate order) and the density."""
    bs = cfg.block_size
    nb = pattern.kind.shape[1]
    total_rows = group * seqlen
    r0 = torch.arange(_cdiv(total_rows, Q_TILE)) * Q_TILE
    r1 = torch.clamp(r0 + Q_TILE, max=total_rows)
    rows, pmin, pmax = r1 - r0, r0 // group, (r1 - 1) // group
    sink_blocks = _cdiv(cfg.sink_tokens, bs)
    # Window: blocks whose last key is >= pmin + 1 - W, i.e. J >= ceil((pmin + 2 - W) / bs) - 1;
    # from the first not fully visible block on, the diagonal is forced too.
    first = -torch.div(cfg.window_tokens - pmin - 2, bs, rounding_mode="floor") - 1
    window_block = torch.minimum(torch.clamp(first, min=0), (pmin + 1) // bs)
    # Forced pairs per KV head: each row p sees the sink keys and the keys from the window on.
    sink_keys = min(sink_blocks * bs, seqlen)
    pos = torch.arange(seqlen)
    forced = 0
    for t in range(group):
        tile = (pos * group + t) // Q_TILE
        start = torch.clamp(window_block[tile] * bs, min=sink_keys)
        forced += int((torch.clamp(pos + 1, max=sink_keys) + torch.clamp(pos + 1 - start, min=0)).sum())
    causal = group * seqlen * (seqlen + 1) // 2
    # A stripe at block J adds its keys to every row of the tiles whose open range
    # [sink_blocks, window_block) contains J, unless slash or a needle selects it already.
    weight = (rows * bs).double()
    by_window = torch.bincount(window_block, weights=weight, minlength=nb + 1)[: nb + 1]
    reach = by_window.flip(0).cumsum(0).flip(0)[1:]  # [nb]: sum of weights of tiles with wb > J
    reach[:sink_blocks] = 0
    base, gains = 0.0, []
    for h in range(pattern.kind.shape[0]):
        tile, block = _slash_and_needles(pattern, h, pmin, pmax, bs)
        inside = (block >= sink_blocks) & (block < window_block[tile])
        tile, block = tile[inside], block[inside]
        base += float(weight[tile].sum())
        gain = reach.clone().index_add_(0, block, -weight[tile])
        gains.append(torch.cat([gain.new_zeros(1), gain[candidates[h]].cumsum(0)]))
    heads = len(gains)
    n_max = min(len(g) for g in gains) - 1
    cum = torch.stack([g[: n_max + 1] for g in gains]).sum(0)
    dens = (heads * forced + base + cum) / (heads * causal)
    n = int(torch.argmin((dens - target).abs()))
    return [c[:n] for c in candidates], float(dens[n])


def _slash_and_needles(pattern: _Pattern, h: int, pmin: torch.Tensor, pmax: torch.Tensor,
                       bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile, block) pairs that the slash and needle components make salient (no duplicates)."""
    kind = pattern.kind[h]
    nb = kind.shape[0]
    tiles = torch.arange(len(pmin))
    qblock = pmin // bs  # exact when g | 128: a tile lies inside one query block
    pairs_t, pairs_j = [], []
    delta = pattern.slash_delta[h]
    if delta is not None:
        for m in range(nb // pattern.slash_mod + 1):
            j = qblock - delta - m * pattern.slash_mod
            ok = (j >= 0) & (kind[j.clamp(min=0)] == _SLASH)
            pairs_t.append(tiles[ok])
            pairs_j.append(j[ok])
    for key_block, qb0, qb1 in pattern.needles[h].tolist():
        if qb1 > qb0:
            t = tiles[(pmin >= qb0 * bs) & (pmax < qb1 * bs)]
            pairs_t.append(t)
            pairs_j.append(torch.full_like(t, key_block))
    if not pairs_t:
        return tiles[:0], tiles[:0]
    return torch.cat(pairs_t), torch.cat(pairs_j)


# ---------------------------------------------------------------------------------------------
# Token-level tensors (device)


def _block_centered(x: torch.Tensor, bs: int) -> torch.Tensor:
    """``x`` (token axis 1) minus the mean of its key block (the last block may be short)."""
    length = x.shape[1]
    nb = _cdiv(length, bs)
    pad = nb * bs - length
    xp = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], 1) if pad else x
    sums = xp.reshape(x.shape[0], nb, bs, *x.shape[2:]).sum(2)
    counts = torch.full((nb,), float(bs), device=x.device)
    counts[-1] = length - (nb - 1) * bs
    means = sums / counts.view(1, nb, *([1] * (x.dim() - 2)))
    return x - means.repeat_interleave(bs, 1)[:, :length]


def _local_band(seqlen: int, heads: int, dims: int, device: torch.device,
                gen: torch.Generator) -> torch.Tensor:
    """Unit vectors ``[L, Hkv, dims]`` drifting smoothly with position."""
    radius = int(4 * LOCAL_SMOOTHING)
    taps = torch.arange(-radius, radius + 1, device=device, dtype=torch.float32)
    kernel = torch.exp(-0.5 * (taps / LOCAL_SMOOTHING) ** 2)
    channels = heads * dims
    white = torch.randn(1, channels, seqlen + 2 * radius, generator=gen, device=device)
    smooth = torch.nn.functional.conv1d(white, kernel.expand(channels, 1, -1).contiguous(), groups=channels)
    r = smooth[0].reshape(heads, dims, seqlen).permute(2, 0, 1)
    return r / r.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def _materialise(
    seqlen: int, batch: int, num_kv_heads: int, group: int, layout: _Layout, pattern: _Pattern,
    cfg: SparseConfig, device: torch.device, gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 q ``[B, L, Hq, d]``, k and v ``[B, L, Hkv, d]``; ``scale * q . k`` is the designed
    logit for the default ``scale = 1/sqrt(d)``."""
    L, B, H, g, d, bs = seqlen, batch, num_kv_heads, group, layout.head_dim, cfg.block_size
    nb = _cdiv(L, bs)
    f32 = dict(dtype=torch.float32, device=device)
    root = math.sqrt(SALIENT_LOGIT)  # query amplitude of every salient component
    pos = torch.arange(L, device=device)
    blk = pos // bs
    kind = pattern.kind.to(device)
    n_content = d - layout.content0
    sigma = math.sqrt(CONTENT_LOGIT_STD / math.sqrt(n_content))
    local = _local_band(L, H, layout.local, device, gen) if layout.local else None  # [L, H, Dl]
    amp_local = LOCAL_CROSSTALK * math.sqrt(max(layout.local, 1))

    # Queries, in logit units, [B, L, H, g, d].
    q = torch.zeros(B, L, H, g, d, **f32)
    q[..., layout.sink] = root
    q[..., layout.stripe] = root
    needles = pattern.needles.to(device)
    qs, qe = needles[..., 1] * bs, needles[..., 2] * bs  # [H, n]
    looking = (pos[:, None, None] >= qs[None]) & (pos[:, None, None] < qe[None])  # [L, H, n]
    q[..., layout.needle0 : layout.slash0] = root * looking[None, :, :, None, :].float()
    if layout.slash:
        code = torch.nn.functional.one_hot(blk % layout.slash, layout.slash).float()  # [L, N]
        on = torch.tensor([x is not None for x in pattern.slash_delta], device=device).float()
        q[..., layout.slash0 : layout.local0] = root * code[None, :, None, None, :] * on[None, None, :, None, None]
    if local is not None:
        q[..., layout.local0 : layout.content0] = amp_local * local[None, :, :, None, :]
    q[..., layout.content0 :] = sigma * torch.randn(B, L, H, g, n_content, generator=gen, **f32)

    # Keys: zero block mean everywhere but in the planted components.
    k = torch.zeros(B, L, H, d, **f32)
    if local is not None:
        k[..., layout.local0 : layout.content0] = _block_centered(local[None], bs)
    content = sigma * torch.randn(B, L, H, n_content, generator=gen, **f32)
    k[..., layout.content0 :] = _block_centered(content, bs)
    spread = _block_centered(TOKEN_SPREAD * torch.randn(B, L, H, generator=gen, **f32), bs)
    n0 = min(bs, L)
    if n0 > 1:  # the sink block: a BOS spike, the rest slightly lower (block mean unchanged)
        bos = torch.full((n0,), -BOS_BOOST / (n0 - 1), **f32)
        bos[0] = BOS_BOOST
        spread[:, :n0] = bos[None, :, None]
    level = pattern.level.to(device)[:, blk].T  # [L, H]
    planted = (kind[:, blk].T != _NONE)[None]  # [1, L, H]
    logit = torch.where(planted, level[None] + spread, torch.zeros_like(spread))
    index = pattern.coord.to(device)[:, blk].T[None, :, :, None].expand(B, L, H, 1)
    k.scatter_add_(-1, index, (logit / root)[..., None])

    # Values: unit token noise plus a per-block offset.
    v = torch.randn(B, L, H, d, generator=gen, **f32)
    v += VALUE_BLOCK_STD * torch.randn(B, nb, H, d, generator=gen, **f32)[:, blk]

    rot = pattern.rotation.to(device)
    gain = d ** 0.25  # scale * q . k = (q~ . k~) with scale = 1/sqrt(d)
    q = torch.einsum("blhgd,hed->blhge", q, rot).reshape(B, L, H * g, d) * gain
    k = torch.einsum("blhd,hed->blhe", k, rot) * gain
    return q, k, v
