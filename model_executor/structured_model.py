"""A Llama-3.1-8B-shaped ``LlamaForCausalLM`` with constructed attention, for density and speed benchmarks.

Random weights give attention with no structure: every block scores alike and the index keeps
almost everything. Real models show sinks, locality and retrieval heads; this module writes
those into the weights of a transformers ``LlamaForCausalLM`` (Llama-3.1-8B's shape: 32 layers,
hidden 4096, 32/8 heads, d 128, MLP 14336, vocab 128256, RoPE theta 500000 with llama3 scaling;
``num_layers`` and the widths can be reduced) so that the operator's index stage, run on the
model's real per-layer q/k, selects about as much as the paper reports on Llama-3.1-8B
(Table 3: 76/54/34/19/9/4.6% at 4K..128K).

Construction (all layers alike; ``d`` head dim, RoPE pair ``f`` = dims ``(f, f + d/2)`` with
angular frequency ``w_f`` read from the model's own rotary embedding)

* Embeddings. Every row has norm ``sqrt(hidden)`` (RMS 1): ``e_t = sqrt(hidden) * (cos(th) u0
  + sin(th) eps_t)`` with ``u0`` the basis vector 0 shared by all tokens (the "DC" direction that
  carries position-only structure), ``eps_t`` a random unit vector in dims 2.. (token identity),
  and for BOS ``eps_BOS = u1`` (basis vector 1). ``cos(th) = 0.5``. Norm weights are ones.
* Locality (every head). ``q`` and ``k`` both get ``sqrt(a_f / scale)`` in the first dim of each
  RoPE pair ``f`` whose wavelength ``2 pi / w_f`` lies in the head's band, read from ``u0``;
  after RoPE the logit between positions ``p`` and ``j`` is ``sum_f a_f cos(w_f (p - j))``:
  ``locality_logit`` at distance 0, decaying over the band's wavelengths, then fluctuating
  around 0. ``a_f`` is ``locality_logit`` split evenly over the band's pairs.
* Sink (every head). The query reads ``u0`` into the first dim of the most slowly rotating pair
  (wavelength > 4M tokens), the key reads ``u1`` (BOS only) into the same dim: every query
  scores BOS ``sink_logit`` higher than it otherwise would.
* Retrieval (heads of type ``retrieval``). ``q = k = sqrt(match / scale) * P eps_t`` on the next
  slowest pairs (near-constant rotation up to 128K; 11 pairs at d = 128), ``P`` a random
  projection normalised so that a token matches its own earlier copies with logit ~``match_logit``
  and other tokens with logit ~N(0, match^2 / dims). Other heads get independent small random
  q/k content (``content_noise`` logit std) so that token-level attention is not purely
  positional.
* Head types by KV head (selection is shared by the query heads of a KV head, so types are per
  KV head): ``local`` (band 1.9K..81K tokens), ``retrieval`` (2.8K..100K, plus the match) and
  ``broad`` (4.5K..122K), cycled over the KV heads and shifted by one per layer. With alpha 0.1 a
  block is kept while its mean logit is within ``ln 10`` of the best block's, so the bands set
  how far back the index reaches: about 1.2K, 2K and 3.5K tokens, on top of sink and window.
* Values, outputs, MLPs: random, scaled so that each attention and MLP output adds about
  ``residual_scale`` (5%) of the embedding's RMS: later layers see nearly the same structure.

``tiny_spec`` shrinks everything for CPU tests (2 layers, hidden 512, 8/2 heads, d 64) and its
bands by 4x, for block 64 / sink 64 / window 128 at 1K..4K.

The density measurement on this model lives in ``evals.structured_model``.
"""

from __future__ import annotations

import math

import torch

from .structured_spec import (  # noqa: F401 - the specs live there (torch-free); re-exported
    DEFAULT_BANDS, LLAMA3_BOS, QWEN_ENDOFTEXT, HeadBand, StructuredModelSpec, head_type, llama31_8b_spec,
    llama31_70b_spec, llama_config, qwen25_32b_spec, tiny_spec,
)


def _band_pairs(inv_freq: torch.Tensor, band: HeadBand, scale: float) -> torch.Tensor:
    wavelength = 2 * math.pi / inv_freq.double()
    return ((wavelength >= band.lo * scale) & (wavelength <= band.hi * scale)).nonzero().flatten()


def check_bands(spec: StructuredModelSpec, inv_freq: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each band's RoPE pairs (``inv_freq``: the model's rotary frequencies); ValueError if a band
    holds none or overlaps the sink/content pairs."""
    order = torch.argsort(inv_freq.double())
    reserved = set(order[: 1 + spec.content_pairs].tolist())
    bands = {b.name: _band_pairs(inv_freq, b, spec.band_scale) for b in spec.bands}
    for name, pairs in bands.items():
        if pairs.numel() == 0:
            raise ValueError(f"bands: band {name!r} holds no RoPE pair at band_scale {spec.band_scale}")
        if set(pairs.tolist()) & reserved:
            raise ValueError(f"bands: band {name!r} overlaps the sink/content pairs; shrink it or content_pairs")
    return bands


@torch.no_grad()
def build_structured_llama(
    spec: StructuredModelSpec, *, device="cpu", dtype=torch.bfloat16,
):
    """A ``LlamaForCausalLM`` with the constructed weights (see the module doc), in eval mode."""
    from transformers import LlamaForCausalLM

    config = llama_config(spec)
    device = torch.device(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters born in dtype: no transient fp32 copy (32 GB at 8B)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    inv_freq = model.model.rotary_emb.inv_freq.detach().double().cpu()
    d, half = spec.head_dim, spec.head_dim // 2
    hq, hkv, hidden = spec.num_attention_heads, spec.num_key_value_heads, spec.hidden_size
    group = hq // hkv
    scale = 1.0 / math.sqrt(d)
    gen = torch.Generator(device=device).manual_seed(spec.seed)

    def randn(*shape):  # drawn on the target device: 1.5G numbers at the 8B shape
        return torch.randn(*shape, generator=gen, dtype=torch.float32, device=device)

    # Pairs: slowest one for the sink, the next ``content_pairs`` for token content.
    order = torch.argsort(inv_freq)  # slowest first
    sink_pair = int(order[0])
    content_pairs = order[1 : 1 + spec.content_pairs]
    content_dims = torch.cat([content_pairs, content_pairs + half])
    bands = check_bands(spec, inv_freq)

    # Embeddings: RMS 1, shared DC direction u0 (dim 0), BOS direction u1, token part in dims 2..
    cos_t = 0.5
    sin_t = math.sqrt(1 - cos_t**2)
    root = math.sqrt(hidden)
    emb = torch.empty(spec.vocab_size, hidden, dtype=dtype, device=device)
    chunk = 8192
    for r0 in range(0, spec.vocab_size, chunk):
        eps = randn(min(chunk, spec.vocab_size - r0), hidden - 2)
        eps = eps / eps.norm(dim=1, keepdim=True)
        emb[r0 : r0 + eps.shape[0], 2:] = (root * sin_t * eps).to(dtype)
    emb[:, 0] = root * cos_t
    emb[:, 1] = 0.0
    emb[spec.bos_token_id, 2:] = 0.0
    emb[spec.bos_token_id, 1] = root * sin_t
    model.model.embed_tokens.weight.copy_(emb)
    del emb
    dc = root * cos_t  # x_hat . u0 for every token (before later layers' small additions)
    bos_in = root * sin_t  # x_hat . u1 for BOS
    tok_in = root * sin_t  # norm of the token part of x_hat

    nc = content_dims.numel()
    for layer_idx, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        wq = torch.zeros(hq, d, hidden, device=device)
        wk = torch.zeros(hkv, d, hidden, device=device)
        for kv in range(hkv):
            band = head_type(spec, layer_idx, kv)
            pairs = bands[band.name]
            amp = math.sqrt(spec.locality_logit / pairs.numel() / scale)
            sink_amp = math.sqrt(spec.sink_logit / scale)
            wk[kv, pairs, 0] = amp / dc
            wk[kv, sink_pair, 1] = sink_amp / bos_in
            # token content: a shared projection for retrieval heads, independent noise otherwise
            proj_k = randn(nc, hidden - 2) / math.sqrt(hidden - 2) * math.sqrt((hidden - 2) / nc)
            if band.retrieval:
                strength_k = math.sqrt(spec.match_logit / scale)
            else:
                strength_k = math.sqrt(spec.content_noise * math.sqrt(nc) / scale)
            wk[kv, content_dims, 2:] = strength_k * proj_k / tok_in
            for t in range(group):
                h = kv * group + t
                wq[h, pairs, 0] = amp / dc
                wq[h, sink_pair, 0] = sink_amp / dc
                proj_q = proj_k if band.retrieval else randn(nc, hidden - 2) / math.sqrt(nc)
                wq[h, content_dims, 2:] = strength_k * proj_q / tok_in
        attn.q_proj.weight.copy_(wq.reshape(hq * d, hidden).to(device, dtype))
        attn.k_proj.weight.copy_(wk.reshape(hkv * d, hidden).to(device, dtype))
        # values ~N(0, 1) per entry; outputs add ~residual_scale RMS to the residual stream
        attn.v_proj.weight.copy_((randn(hkv * d, hidden) / root).to(device, dtype))
        attn.o_proj.weight.copy_((randn(hidden, hq * d) * spec.residual_scale / math.sqrt(hq * d)).to(device, dtype))
        inter = spec.intermediate_size
        mlp.gate_proj.weight.copy_((randn(inter, hidden) / root).to(device, dtype))
        mlp.up_proj.weight.copy_((randn(inter, hidden) / root).to(device, dtype))
        mlp.down_proj.weight.copy_((randn(hidden, inter) * spec.residual_scale / math.sqrt(0.3 * inter)).to(device, dtype))
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
    model.model.norm.weight.fill_(1.0)
    return model


def haystack_ids(spec: StructuredModelSpec, length: int, *, seed: int = 0, needle_len: int = 16,
                 pool: int = 20000) -> torch.Tensor:
    """``[1, length]`` NIAH-like prompt: BOS, filler drawn from ``pool`` token ids, a random
    needle of ``needle_len`` ids at a random depth, and the same needle again at the end."""
    g = torch.Generator().manual_seed(seed)
    lo = 1000 if spec.vocab_size > 2 * pool else 2
    pool = min(pool, spec.vocab_size - lo - 1)
    ids = torch.randint(lo, lo + pool, (length,), generator=g)
    needle = torch.randint(lo, lo + pool, (needle_len,), generator=g)
    at = int(torch.randint(1, max(2, length - 2 * needle_len), (1,), generator=g))
    ids[at : at + needle_len] = needle
    ids[-needle_len:] = needle
    ids[0] = spec.bos_token_id
    return ids[None]
