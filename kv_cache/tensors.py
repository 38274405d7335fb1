"""The K/V tensors of a paged pool and the writes into them (``KVTensors``): no bookkeeping of
who holds which page (``kv_cache.manager``); ``KVPool`` (``kv_cache.pool``) puts the two together.

Layout (the paged layout of SPEC.md, one pool for all layers):
- ``k``, ``v``: separate tensors ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``.
  Layer ``l``'s ``k_pages = tensors.k[l]`` (a view) is what the attention kernels take.
- A page holds ``page_size`` tokens x ``num_kv_heads`` x ``head_dim`` for K and for V, in
  every layer: one page id addresses the same slots in all layers. Token ``j`` of a request
  lives at page ``pages[j // page_size]``, slot ``j % page_size``; its flat slot (for ``write``)
  is ``pages[j // page_size] * page_size + j % page_size``.

FP8 (``torch.float8_e4m3fn``): pages store ``x / scale`` rounded to e4m3 (saturating at
+-448); ``k_scale``/``v_scale`` ``[num_layers, num_kv_heads]`` float32 are the descale
factors (``x ~= stored * scale``). They start at 1.0; set them per layer once, before the
first write of that layer (``set_scales`` or ``calibrate_scales`` from an amax): changing a
scale does not rescale pages already written. V is stored *token-major* (``v_raw``
``[num_layers, num_pages, num_kv_heads, head_dim, page_size]``; ``v`` is the same memory seen
as ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``): the K-major operand that
Hopper's fp8 tensor cores take for P V, so the CUTLASS attention stage reads it directly. A page
is still one contiguous block per layer; transfers copy ``k_raw``/``v_raw`` page by page, and
both ends of a transfer hold the same layout (it follows from the dtype).

CUDA tensors are allocated outside torch's expandable segments (see ``_plain_cuda_segments``) so
that a decode replica on the same GPU can map them through CUDA IPC (``kv_transfer.cuda_ipc``).

``write`` and ``copy_pages`` touch only the data of pages the caller owns and take no lock.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence

import torch

from kernels import fp8
from kernels._checks import canonical_device

from .config import KVPoolConfig


class KVTensors:
    """Preallocated paged K/V storage for all layers (plus FP8 descales)."""

    def __init__(self, config: KVPoolConfig) -> None:
        if not isinstance(config, KVPoolConfig):
            raise ValueError(f"config: expected a KVPoolConfig, got {type(config).__name__}")
        self.config = config
        self.num_pages = config.capacity
        self.page_size = config.page_size
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.dtype = config.dtype
        self.device = canonical_device(config.device)  # cuda:<current>, as the tensors report it
        shape = (config.num_layers, self.num_pages, config.page_size, config.num_kv_heads, config.head_dim)
        # zeros, not empty: padding slots hold finite values, so a masked read stays finite
        with _plain_cuda_segments(self.device):
            self.k = torch.zeros(shape, dtype=config.dtype, device=self.device)
            if config.v_token_major:
                self.v_raw = torch.zeros((*shape[:2], shape[3], shape[4], shape[2]), dtype=config.dtype,
                                         device=self.device)
                self.v = self.v_raw.permute(0, 1, 4, 2, 3)
            else:
                self.v = self.v_raw = torch.zeros(shape, dtype=config.dtype, device=self.device)
        self.k_raw = self.k
        if config.dtype == torch.float8_e4m3fn:
            scale_shape = (config.num_layers, config.num_kv_heads)
            self.k_scale: torch.Tensor | None = torch.ones(scale_shape, dtype=torch.float32, device=self.device)
            self.v_scale: torch.Tensor | None = torch.ones(scale_shape, dtype=torch.float32, device=self.device)
        else:
            self.k_scale = None
            self.v_scale = None

    def copy_pages(self, src: int, dsts: Sequence[int]) -> None:
        """Page ``src`` into each of ``dsts``, every layer, K and V, byte for byte (a fork's
        copy-on-write of a partial page)."""
        if not dsts:
            return
        dst = torch.tensor(list(dsts), dtype=torch.long, device=self.device)
        for raw in (self.k_raw, self.v_raw):  # V token-major or not, a page is one block per layer
            words = raw.view(torch.uint8).view(self.num_layers, self.num_pages, -1)
            words[:, dst] = words[:, src].unsqueeze(1)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              backend: str = "auto") -> None:
        """Scatter ``k, v [T, Hkv, d]`` into layer ``layer`` at flat ``slots [T]`` (from
        ``slot_mapping``; their values are not checked, to stay free of host syncs).
        FP8 pools store ``x / scale`` saturated to e4m3: with ``backend`` ``"auto"`` (on CUDA) or
        ``"triton"`` one fused kernel quantizes and scatters K and V (``kernels/triton_fp8.py``),
        ``"reference"`` does it in eager PyTorch; the same bytes either way."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots: expected a 1-D int64 (or int32) tensor, got {_describe(slots)}")
        if slots.device != self.device:
            raise ValueError(f"slots: expected a tensor on {self.device}, got one on {slots.device}")
        want = (slots.shape[0], self.num_kv_heads, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
                raise ValueError(f"{name}: expected shape {want} (T from slots), got {_describe(x)}")
            if not x.is_floating_point():
                raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")
            if x.device != self.device:
                raise ValueError(f"{name}: expected a tensor on {self.device}, got one on {x.device}")
        if backend not in ("auto", "triton", "reference"):
            raise ValueError(f"backend: expected 'auto', 'triton' or 'reference', got {backend!r}")
        if self.k_scale is not None and (backend == "triton" or (backend == "auto" and self.device.type == "cuda")):
            from kernels import triton_fp8
            from kernels.ops import triton_available

            if not triton_available(self.device):
                raise ValueError(f"backend: 'triton' needs a CUDA pool or TRITON_INTERPRET=1, this one is on {self.device}")
            triton_fp8.write_pages(_last_contiguous(k), _last_contiguous(v), slots.contiguous(),
                                   self.k_scale[layer], self.v_scale[layer], self.k[layer], self.v_raw[layer])
            return
        index = slots.long()
        for pages, x, scale in ((self.k, k, self.k_scale), (self.v, v, self.v_scale)):
            data = x.to(self.dtype) if scale is None else quantize_fp8(x, scale[layer])
            if pages is self.v and self.config.v_token_major:
                # [pages, H, d, page_size] bytes: token t at (slot // page_size, :, :, slot % page_size)
                raw = self.v_raw[layer].view(torch.uint8)
                raw[index // self.page_size, :, :, index % self.page_size] = data.view(torch.uint8)
                continue
            flat = pages[layer].view(-1, self.num_kv_heads, self.head_dim)
            if scale is None:
                flat.index_copy_(0, index, data)
            else:
                flat.view(torch.uint8).index_copy_(0, index, data.view(torch.uint8))

    def set_scales(self, layer: int, k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> None:
        """FP8 pools: set layer ``layer``'s descale factors (a float or ``[num_kv_heads]``)."""
        if self.k_scale is None:
            raise ValueError(f"k_scale: only FP8 pools have scales, this pool stores {self.dtype}")
        for name, dst, val in (("k_scale", self.k_scale, k_scale), ("v_scale", self.v_scale, v_scale)):
            t = torch.as_tensor(val, dtype=torch.float32, device=self.device).expand(self.num_kv_heads)
            if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise ValueError(f"{name}: expected positive finite scales, got {t.tolist()}")
            dst[layer] = t

    def calibrate_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, margin: float = 1.0) -> None:
        """FP8 pools: per-KV-head scales ``amax * margin / 448`` from sample ``k, v [T, Hkv, d]``."""
        self.set_scales(layer, fp8_scale_from_amax(k, margin=margin), fp8_scale_from_amax(v, margin=margin))


_EXPANDABLE_ON = re.compile(r"expandable_segments\s*:\s*True")


@contextlib.contextmanager
def _plain_cuda_segments(device: torch.device):
    """Allocate outside torch's expandable segments, where the process turned them on through
    ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``.

    Why: a same-GPU decode replica maps this pool through CUDA IPC (``kv_transfer.cuda_ipc``). A
    plain segment is shared with ``cudaIpcGetMemHandle``; an expandable one through a POSIX fd
    that the importer pulls with ``pidfd_getfd``, which needs ptrace rights over the exporter
    that sibling Ray workers usually lack (Yama ``ptrace_scope=1``, container seccomp). The
    pool is one fixed allocation, so expandable segments buy it nothing. The setting is
    process-wide while it lasts (pools are built at replica start, before serving); the
    original string is set back whole, since parsing a settings string resets the keys it
    leaves out."""
    conf_var = next((v for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
                     if _EXPANDABLE_ON.search(os.environ.get(v, ""))), None)
    if device.type != "cuda" or conf_var is None:
        yield
        return
    original = os.environ[conf_var]
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    try:
        setter(_EXPANDABLE_ON.sub("expandable_segments:False", original))
        switched = True
    except Exception:  # an allocator without the option: allocate as configured
        switched = False
    try:
        yield
    finally:
        if switched:
            setter(original)


_COPY_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def copy_word(*byte_counts: int) -> torch.dtype:
    """The widest integer dtype dividing every one of ``byte_counts`` (a K/V row of head_dim
    elements, a tensor's byte offset, ...), for copying pages through integer views:
    index_select/index_copy_ move one element per index computation, so 8-byte words move 8x
    the bytes per step of a byte view, and integer views also cover FP8, which those kernels
    lack. The copy is exact whatever the word."""
    for word in _COPY_WORDS:
        size = torch.empty((), dtype=word).element_size()
        if all(n % size == 0 for n in byte_counts):
            return word
    raise AssertionError("unreachable: uint8 divides everything")


def pool_page_words(pool: KVTensors, word: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``pool.k_raw`` and ``pool.v_raw`` (of ``KVTensors`` or the ``KVPool`` holding them) as
    ``[num_layers, num_pages, words]`` views of ``word`` (default: the widest integer one page of
    one layer divides into): a page of a layer is one contiguous run of the storage whatever V's
    layout, so transfers copy pages as words."""
    if word is None:
        word = copy_word(pool.page_size * pool.num_kv_heads * pool.head_dim * pool.k.element_size())
    shape = (pool.num_layers, pool.num_pages, -1)
    return (pool.k_raw.view(torch.uint8).view(shape).view(word),
            pool.v_raw.view(torch.uint8).view(shape).view(word))


def fp8_scale_from_amax(x: torch.Tensor, *, margin: float = 1.0) -> torch.Tensor:
    """Per-head descale ``[H]`` so that ``x [T, H, d] / scale`` spans e4m3's range."""
    return fp8.descale_from_amax(x.detach().float().abs().amax(dim=(0, 2)), margin=margin)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [T, H, d] / scale [H]`` saturated to +-448 and rounded to e4m3 (``kernels.fp8``)."""
    return fp8.quantize(x, scale.view(1, -1, 1))


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
