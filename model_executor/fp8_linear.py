"""FP8 (e4m3) weights in the linear layers of the supported models, and the forwards around them.

What is quantized: the projections each decoder layer's family names in its ``fp8_targets``
(``model_executor.models``; Llama 3.x, Qwen2 and Qwen3: ``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``). The embeddings, the norms and ``lm_head``
stay in the model dtype, as vLLM does. An :class:`Fp8Linear` holds the e4m3 weight
``[out, in]`` and its float32 descale in one of ``kernels.fp8_gemm``'s three layouts (``scheme``):
``tensor`` (``[]``), ``channel`` (``[out]``), ``block`` (``[ceil(out/128), in/128]``). Activations
are quantized dynamically on each call: per token for the tensor and channel schemes, per token
and 128-wide group for the block scheme. Output is in the input's dtype (bf16 on the GPU).

Where weights come from:
- :func:`quantize_model` quantizes a loaded model's projections (``weight_dtype`` of
  ``loading.load_model``: ``fp8_tensor``, ``fp8_channel``, ``fp8_block``; ``fp8_e4m3`` is
  ``fp8_channel``): amax per tensor, row or 128x128 tile, descale ``amax / 448``.
- FP8 checkpoints (``loading.load_model_dir`` reads them; :func:`checkpoint_format` parses
  config.json's ``quantization_config``). Tensor names and shapes, as transformers 5.17's own
  integrations read them (``integrations/finegrained_fp8.py`` ``FP8Linear``,
  ``integrations/compressed_tensors.py`` ``CompressedTensorsFP8Linear``):

  - Hugging Face ``quant_method: "fp8"`` (``FineGrainedFP8Config``): ``<module>.weight`` e4m3
    ``[out, in]`` and ``<module>.weight_scale_inv`` float32 (``scale_fmt: "ue8m0"``: e8m0) - despite
    its name the *dequantization* factor (``w = weight * weight_scale_inv``) - of shape
    ``[ceil(out/128), ceil(in/128)]`` with ``weight_block_size: [128, 128]`` (DeepSeek-V3 style),
    ``[]`` (per tensor) with ``weight_block_size: null``. ``activation_scheme: "static"``
    checkpoints also carry ``<module>.activation_scale``: not used (activations are quantized
    dynamically, which is at least as accurate). ``modules_to_not_convert`` modules are stored
    in a float dtype and stay so.
  - compressed-tensors (``quant_method: "compressed-tensors"``, ``format: "float-quantized"``
    or ``"naive-quantized"``) with one config group whose ``weights`` are ``{num_bits: 8, type:
    "float", symmetric: true, strategy: ...}``: ``<module>.weight`` e4m3 ``[out, in]`` and
    ``<module>.weight_scale`` (float32, bf16 or fp16), the dequantization factor, of shape
    ``[out, 1]`` for ``strategy: "channel"``, ``[1]`` (or ``[]``) for ``"tensor"``,
    ``[ceil(out/128), ceil(in/128)]`` for ``"block"`` with ``block_structure: [128, 128]``.
    ``<module>.input_scale`` (static activations) is not used. ``ignore``d modules stay in
    their float dtype.

  Which modules are FP8 is read from the tensors' dtypes; an e4m3 tensor anywhere else
  (embeddings, norms, lm_head) is an error naming it.

Tensor parallelism: :meth:`Fp8Linear.narrow` cuts a shard with its scales (channel and block
scales follow their rows / tiles; a per-tensor scale is kept whole).

The forwards (:func:`install_forwards`, called by ``ModelRunner``):
- ``input_layernorm`` / ``post_attention_layernorm`` whose consumers (q/k/v, gate/up) are all
  Fp8Linear run ``kernels.fp8_gemm.rms_norm_quant``: the normed hidden states and their FP8
  quantization from one pass; the quantized activation travels as an attribute of the output
  tensor (``ACTIVATION_ATTR``) and the projections use it instead of quantizing the same
  activation three (two) times. Everything else reading that output sees the plain tensor.
- SiLU MLPs whose ``down_proj`` is an Fp8Linear run ``kernels.fp8_gemm.silu_mul_quant``:
  ``silu(gate) * up`` quantized for the down projection in one pass, the product itself never
  stored; ``down_proj`` is still called as a module (a TP shard's all-reduce hook runs) on a
  zero-stride placeholder that carries the quantized activation (``ACTIVATION_ATTR``).
- With an FP8 KV pool, the attention modules run a forward whose q goes through
  ``kernels.rope_kv`` (RoPE of q and k, q's max ``|q|`` and the quantized K/V write in one pass;
  ``kernels.fp8_gemm.rotary_amax`` and the pool's write where ``attention.rope_kv_fusable`` says
  no, e.g. while calibrating the scales), q's amax handed to the attention (``query_amax=``), so
  the FP8 operator's per-tensor q descale needs no separate amax pass. The numbers are those of
  the unfused path (same RoPE bits, same amax, same quantization).
"""

from __future__ import annotations

import logging
import math
import types
from dataclasses import dataclass
from typing import Any

import torch

from kernels import elementwise, fp8_gemm
from kernels.fp8 import FP8_DTYPE
from kernels.ranges import op_range

from . import fused, models
from .attention import (ATTENTION_NAME, BATCH_KWARG, ForwardBatch, ForwardMode, paged_attention_forward,
                        rope_and_write_kv, rope_kv_fusable)
from .model_info import WEIGHT_DTYPES

logger = logging.getLogger(__name__)
ACTIVATION_ATTR = "_fp8_activation"  # set on a fused norm's output: its kernels.fp8_gemm.Fp8Activation
_BACKEND_ATTR = "_fp8_forward_backend"


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------


class Fp8Linear(torch.nn.Module):
    """``y = x @ dequant(weight).T + bias`` with an e4m3 ``weight [out, in]`` and its float32
    ``weight_scale`` in ``scheme``'s layout (buffers: ``model.to(dtype)`` would cast them, so cast
    a model before quantizing it). ``backend``: ``kernels.fp8_gemm.fp8_mm``'s."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, scheme: str, *,
                 bias: torch.Tensor | None = None, backend: str = "auto", name: str = "weight") -> None:
        super().__init__()
        n, k = fp8_gemm.check_weight(weight, weight_scale, scheme, name=name)
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)):
            raise ValueError(f"bias: expected a tensor of shape [{n}], got "
                             f"{list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        self.in_features, self.out_features, self.scheme = k, n, scheme
        self.act_group = fp8_gemm.activation_group(scheme)
        self.backend = backend
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, scheme: str, *, backend: str = "auto",
                    name: str = "weight") -> "Fp8Linear":
        """Quantize ``linear``'s weight (its bias stays in its dtype)."""
        fp8_gemm.check_scheme(scheme)
        if scheme == "block":
            fp8_gemm.check_block_in_features(name, linear.in_features)
        w8, scale = fp8_gemm.quantize_weight(linear.weight.detach(), scheme)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(w8, scale, scheme, bias=bias, backend=backend, name=name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != FP8_DTYPE or self.weight_scale.dtype != torch.float32:
            raise ValueError(f"weight: expected float8_e4m3fn with a float32 weight_scale, got {self.weight.dtype} / "
                             f"{self.weight_scale.dtype} (was the model cast with .to(dtype) after quantize_model? "
                             "cast first, then quantize)")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected a last dimension of {self.in_features} (in_features), got {tuple(x.shape)}")
        x2d = x.reshape(-1, self.in_features)
        act = getattr(x, ACTIVATION_ATTR, None)
        if act is None or act.group != self.act_group or act.x8.shape != x2d.shape:
            with op_range("act_quant"):
                act = fp8_gemm.quantize_activation(x2d, self.act_group, backend=self.backend)
        out = fp8_gemm.fp8_mm(act, self.weight, self.weight_scale, self.scheme, out_dtype=x.dtype, bias=self.bias,
                              backend=self.backend, check=False)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """float32 ``[out, in]``."""
        return fp8_gemm.dequantize_weight(self.weight, self.weight_scale, self.scheme)

    def narrow(self, dim: int, start: int, length: int) -> "Fp8Linear":
        """The shard ``weight.narrow(dim, start, length)`` (``dim`` 0: output rows, column parallel;
        1: input columns, row parallel) with its scales; the block scheme needs ``start`` and
        ``length`` multiples of 128 (whole tiles). Row-parallel shards carry no bias (it is added
        once, after the reduction)."""
        if dim not in (0, 1):
            raise ValueError(f"dim: expected 0 (output rows) or 1 (input columns), got {dim!r}")
        size = self.weight.shape[dim]
        if isinstance(start, bool) or isinstance(length, bool) or not (0 <= start and 0 < length
                                                                       and start + length <= size):
            raise ValueError(f"start, length: expected 0 <= start, 0 < length, start + length <= {size}, "
                             f"got {start}, {length}")
        w = self.weight.narrow(dim, start, length).contiguous()
        s = self.weight_scale
        if self.scheme == "block":
            if start % fp8_gemm.BLOCK or (length % fp8_gemm.BLOCK and start + length != size):
                raise ValueError(f"start, length: the block scheme shards whole 128-wide tiles, got {start}, {length}")
            s = s.narrow(dim, start // fp8_gemm.BLOCK, -(-length // fp8_gemm.BLOCK)).contiguous()
        elif self.scheme == "channel" and dim == 0:
            s = s.narrow(0, start, length).contiguous()
        bias = None
        if self.bias is not None and dim == 0:
            bias = self.bias.narrow(0, start, length).contiguous()
        return Fp8Linear(w, s.clone() if s is self.weight_scale else s, self.scheme, bias=bias, backend=self.backend)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}, "
                f"bias={self.bias is not None}")


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------


def _has_targets(spec: models.ArchitectureSpec) -> bool:
    return bool(spec.fp8_targets)


def decoder_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, models.ArchitectureSpec]]:
    """``(name, layer, spec)`` of every decoder layer (a module with ``self_attn`` and ``mlp``);
    ValueError unless each is of a registered family with FP8 targets."""
    layers = models.decoder_layers(model)
    attentions, mlps = (sorted(models.layer_classes(part, _has_targets)) for part in ("attention", "mlp"))
    if not layers:
        raise ValueError(f"model: FP8 weights need decoder layers with self_attn and mlp ({attentions}),"
                         f" found none in {type(model).__name__}")
    out = []
    for name, layer in layers:
        spec = models.for_layer(layer)
        if spec is None or not spec.fp8_targets:
            raise ValueError(f"model: FP8 weights are supported in {attentions} with {mlps}; {name} of "
                             f"{type(model).__name__} has {type(layer.self_attn).__name__} and {type(layer.mlp).__name__}")
        out.append((name, layer, spec))
    return out


def projection_names(model: torch.nn.Module) -> list[str]:
    """The full module names :func:`quantize_model` quantizes (each layer's family's
    ``fp8_targets``), in layer order."""
    names = []
    for name, _, spec in decoder_layers(model):
        prefix = f"{name}." if name else ""
        names += [prefix + spec.projection_path(p) for p in spec.fp8_targets]
    return names


def quantize_model(model: torch.nn.Module, scheme: str, *, backend: str = "auto") -> int:
    """Replace every projection (see the module doc) of ``model`` by an :class:`Fp8Linear` of
    ``scheme``, quantized from its current weight; returns how many. Layers already FP8 are
    left as they are. Cast the model to its dtype and device first."""
    fp8_gemm.check_scheme(scheme)
    names = projection_names(model)
    count = 0
    for name in names:  # check every layer before changing any
        module = model.get_submodule(name)
        if not isinstance(module, (torch.nn.Linear, Fp8Linear)):
            raise ValueError(f"model: {name} is a {type(module).__name__}, expected torch.nn.Linear")
        if scheme == "block" and isinstance(module, torch.nn.Linear):
            fp8_gemm.check_block_in_features(f"{name}.weight", module.in_features)
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, torch.nn.Linear):
            model.set_submodule(name, Fp8Linear.from_linear(module, scheme, backend=backend, name=f"{name}.weight"))
            count += 1
    return count


def fp8_layers(model: torch.nn.Module) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def weight_dtype_of(model: torch.nn.Module) -> str:
    """``"fp8_<scheme>"`` of the model's FP8 layers (``"fp8_mixed"`` for several), else the dtype name."""
    schemes = {m.scheme for m in fp8_layers(model).values()}
    if len(schemes) == 1:
        return f"fp8_{schemes.pop()}"
    if schemes:
        return "fp8_mixed"
    p = next(model.parameters(), None)
    return str(p.dtype).replace("torch.", "") if p is not None else "none"


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes the model's parameters and buffers hold (shared storage once): ``fp8`` (the FP8
    layers' weights, scales and biases), ``other`` and ``total``, with ``fp8_layers``."""
    seen: set[tuple[Any, int]] = set()
    fp8_ids = {id(t) for m in fp8_layers(model).values() for t in m.buffers()}
    out = {"fp8": 0, "other": 0}
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.device, t.untyped_storage().data_ptr()) if t.numel() else (None, id(t))
        if key in seen:
            continue
        seen.add(key)
        out["fp8" if id(t) in fp8_ids else "other"] += t.numel() * t.element_size()
    out["total"] = out["fp8"] + out["other"]
    out["fp8_layers"] = len(fp8_layers(model))
    return out


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointFormat:
    """What config.json's ``quantization_config`` says about the FP8 tensors (see the module doc)."""

    quant_method: str  # "fp8" (Hugging Face) or "compressed-tensors"
    scheme: str  # kernels.fp8_gemm scheme the scales convert to
    scale_suffix: str  # "weight_scale_inv" (fp8) or "weight_scale" (compressed-tensors)

    def scale_name(self, module: str) -> str:
        return f"{module}.{self.scale_suffix}"

    def scale_shapes(self, n: int, k: int) -> list[tuple[int, ...]]:
        """The checkpoint shapes accepted for a ``[n, k]`` weight's scale."""
        if self.scheme == "tensor":
            return [(), (1,), (1, 1)] if self.quant_method == "compressed-tensors" else [(), (1,)]
        if self.scheme == "channel":
            return [(n, 1), (n,)]
        return [(-(-n // fp8_gemm.BLOCK), -(-k // fp8_gemm.BLOCK))]


def _qc_get(qc: Any, key: str, default: Any = None) -> Any:
    return qc.get(key, default) if isinstance(qc, dict) else getattr(qc, key, default)


def checkpoint_format(qc: Any) -> CheckpointFormat:
    """Parse ``quantization_config`` (a dict, or transformers' config object); ValueError naming
    the field for anything but the FP8 formats of the module doc."""
    if hasattr(qc, "to_dict") and not isinstance(qc, dict):
        qc = qc.to_dict()
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config: expected a JSON object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    where = "config.json: quantization_config"
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and list(block) != [fp8_gemm.BLOCK, fp8_gemm.BLOCK]:
            raise ValueError(f"{where}.weight_block_size: expected [128, 128] or null (per tensor), got {block!r}")
        if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise ValueError(f"{where}.activation_scheme: expected 'dynamic' or 'static', got "
                             f"{qc.get('activation_scheme')!r}")
        if qc.get("scale_fmt", "float") not in ("float", "ue8m0"):
            raise ValueError(f"{where}.scale_fmt: expected 'float' or 'ue8m0', got {qc.get('scale_fmt')!r}")
        return CheckpointFormat("fp8", "tensor" if block is None else "block", "weight_scale_inv")
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"{where}.format: expected 'float-quantized' (FP8 compressed-tensors), got {fmt!r}")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or len(groups) != 1:
            raise ValueError(f"{where}.config_groups: expected one FP8 group, got "
                             f"{list(groups) if isinstance(groups, dict) else groups!r}")
        (gname, group), = groups.items()
        w = group.get("weights") if isinstance(group, dict) else None
        field = f"{where}.config_groups.{gname}.weights"
        if not isinstance(w, dict):
            raise ValueError(f"{field}: expected an object, got {w!r}")
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise ValueError(f"{field}: expected num_bits 8 and type 'float' (FP8 e4m3), got num_bits "
                             f"{w.get('num_bits')!r}, type {w.get('type')!r}")
        if w.get("symmetric", True) is not True:
            raise ValueError(f"{field}.symmetric: expected true (e4m3 has no zero point), got {w.get('symmetric')!r}")
        strategy = w.get("strategy")
        if strategy == "block":
            bs = w.get("block_structure")
            if bs is None or list(bs) != [fp8_gemm.BLOCK, fp8_gemm.BLOCK]:
                raise ValueError(f"{field}.block_structure: expected [128, 128], got {bs!r}")
        elif strategy not in ("channel", "tensor"):
            raise ValueError(f"{field}.strategy: expected 'channel', 'tensor' or 'block', got {strategy!r}")
        return CheckpointFormat("compressed-tensors", strategy, "weight_scale")
    raise ValueError(f"{where}.quant_method: expected 'fp8' or 'compressed-tensors' (FP8 checkpoints), got {method!r}")


def convert_scale(name: str, scale: torch.Tensor, fmt: CheckpointFormat, n: int, k: int) -> torch.Tensor:
    """A checkpoint's scale tensor ``name`` for a ``[n, k]`` weight -> float32 in our layout
    (``kernels.fp8_gemm.weight_scale_shape``); ValueError naming it for a wrong shape or dtype, or
    a zero, negative or non-finite factor."""
    shapes = fmt.scale_shapes(n, k)
    if tuple(scale.shape) not in shapes:
        raise ValueError(f"tensor {name}: expected shape {' or '.join(str(list(s)) for s in shapes)} "
                         f"({fmt.quant_method} {fmt.scheme} scale of a [{n}, {k}] weight), got {list(scale.shape)}")
    if not scale.is_floating_point():
        raise ValueError(f"tensor {name}: expected a floating-point scale, got {str(scale.dtype).replace('torch.', '')}")
    out = scale.to(torch.float32).reshape(fp8_gemm.weight_scale_shape(fmt.scheme, n, k)).contiguous()
    if not bool((torch.isfinite(out) & (out > 0)).all()):
        raise ValueError(f"tensor {name}: expected positive finite scale factors, got {out.flatten()[:8].tolist()}")
    return out


# ---------------------------------------------------------------------------------------------
# the forwards around the FP8 layers
# ---------------------------------------------------------------------------------------------


def _norm_quant_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    with op_range("norm"):
        y, act = fp8_gemm.rms_norm_quant(hidden_states, self.weight, self.variance_epsilon, self._fp8_act_group,
                                         backend=getattr(self, _BACKEND_ATTR))
    setattr(y, ACTIVATION_ATTR, act)  # read by the layer's Fp8Linear projections
    return y


def _silu_quant_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    with op_range("gate_up_gemm"):
        gate, up = self.gate_proj(x), self.up_proj(x)
    with op_range("silu_mul"):
        act = fp8_gemm.silu_mul_quant(gate, up, self.down_proj.act_group, backend=getattr(self, _BACKEND_ATTR))
    # the product is never stored: down_proj reads the quantized activation off a placeholder
    # of the product's shape with no storage of its own
    carrier = gate.new_empty(()).expand(gate.shape)
    setattr(carrier, ACTIVATION_ATTR, act)
    with op_range("down_gemm"):
        return self.down_proj(carrier)


def _q_amax_attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                              past_key_values=None, **kwargs):
    d = self.head_dim
    batch = kwargs.get(BATCH_KWARG)
    if (past_key_values is not None or position_embeddings is None or hidden_states.dim() != 3
            or hidden_states.shape[0] != 1 or self.config._attn_implementation != ATTENTION_NAME
            or not isinstance(batch, ForwardBatch) or getattr(self, "sliding_window", None) is not None
            or tuple(position_embeddings[0].shape[-2:]) != (hidden_states.shape[1], d)):
        return type(self).forward(self, hidden_states, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
    n = hidden_states.shape[1]
    backend = getattr(self, _BACKEND_ATTR)
    cos, sin = (c.reshape(n, d) for c in position_embeddings)
    with op_range("qkv_gemm"):
        q = self.q_proj(hidden_states).view(n, -1, d)
        k = self.k_proj(hidden_states).view(n, -1, d)
        v = self.v_proj(hidden_states).view(n, -1, d)
    if getattr(self, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm before RoPE
        with op_range("norm"):
            q, k = self.q_norm(q), self.k_norm(k)
    extra = {}
    q_amax = batch.mode is ForwardMode.PREFILL and batch.pool.k_scale is not None
    # RoPE, q's amax and the K/V write in one pass, with the fused ops (fused_ops=False: the
    # reference rotary here, then the pool's own write with the runner's backend)
    if backend != "reference" and rope_kv_fusable(batch, q.dtype):
        out = rope_and_write_kv(self, batch, q, k, v, cos, sin, backend=backend, q_amax=q_amax)
        q, extra["query_amax"] = out if q_amax else (out, None)
        extra["kv_written"] = True
    else:
        with op_range("rope"):
            k = elementwise.rotary(k, cos, sin, backend=backend)
            if q_amax:
                q, extra["query_amax"] = fp8_gemm.rotary_amax(q, cos, sin, backend=backend)
            else:
                q = elementwise.rotary(q, cos, sin, backend=backend)
    out, weights = paged_attention_forward(self, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attention_mask, dropout=0.0,
                                           scaling=self.scaling, **kwargs, **extra)
    with op_range("o_gemm"):
        return self.o_proj(out.reshape(1, n, -1)), weights


_FORWARDS = {_norm_quant_forward: "norm_quant", _q_amax_attention_forward: "q_amax",
             _silu_quant_mlp_forward: "silu_quant"}
KINDS = ("fp8_linear", "norm_quant", "q_amax", "silu_quant")


def _ours(module: torch.nn.Module) -> str | None:
    return _FORWARDS.get(getattr(module.__dict__.get("forward"), "__func__", None))


def _set(module: torch.nn.Module, forward, backend: str) -> None:
    setattr(module, _BACKEND_ATTR, backend)
    module.forward = types.MethodType(forward, module)


def _unset(module: torch.nn.Module) -> None:
    if _ours(module) is not None:
        del module.forward
        module.__dict__.pop(_BACKEND_ATTR, None)


def _plain_norm(module: object, classes: frozenset[str]) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__ in classes and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), (int, float)))


def _shared_group(modules: list[Any]) -> tuple[bool, int | None]:
    """Whether all ``modules`` are Fp8Linear reading one activation granularity, and which."""
    if not all(isinstance(m, Fp8Linear) for m in modules):
        return False, None
    groups = {m.act_group for m in modules}
    return len(groups) == 1, groups.pop() if len(groups) == 1 else None


def install_forwards(model: torch.nn.Module, *, kernels: bool, fp8_pool: bool, linear_backend: str = "auto",
                     ) -> dict[str, int]:
    """Install (or remove) the forwards of the module doc; idempotent. ``kernels``: the norms
    and RoPE run the Triton kernels (else the PyTorch references: the same math);
    ``fp8_pool``: the KV pool is FP8 (the q-amax attention forward); ``linear_backend``: every
    Fp8Linear's GEMM backend. The SiLU MLPs with an FP8 ``down_proj`` get the SiLU-mul ->
    FP8 forward either way (``kernels``: Triton, else the reference). Call it after ``fused.install``/``uninstall`` (those replace the
    same norms' and attentions' forwards). Returns how many modules of each kind are set."""
    counts = dict.fromkeys(KINDS, 0)
    backend = "triton" if kernels else "reference"
    for m in fp8_layers(model).values():
        m.backend = linear_backend
        counts["fp8_linear"] += 1
    block = next((m for m in fp8_layers(model).values() if m.scheme == "block" and m.weight.is_cuda), None)
    if block is not None and linear_backend == "auto":  # the block GEMM is chosen here, at load
        why = fp8_gemm.blockwise_probe_failure(block.weight.device)
        logger.info("FP8 block-scaled GEMMs: %s", "torch._scaled_mm (1x128 x 128x128 scales)" if why is None
                    else f"the Triton kernel (torch._scaled_mm's blockwise mode: {why})")
    norms = models.layer_classes("norm", _has_targets)
    attentions = models.layer_classes("attention", lambda spec: spec.fp8_attention)
    for _, layer in models.decoder_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        for norm_name, consumers in (("input_layernorm", [getattr(attn, p, None) for p in ("q_proj", "k_proj", "v_proj")]),
                                     ("post_attention_layernorm", [getattr(mlp, p, None) for p in ("gate_proj", "up_proj")])):
            norm = getattr(layer, norm_name, None)
            if norm is None:
                continue
            ok, group = _shared_group(consumers)
            if ok and _plain_norm(norm, norms) and (group is None or norm.weight.shape[0] % fp8_gemm.BLOCK == 0):
                norm._fp8_act_group = group
                _set(norm, _norm_quant_forward, backend)
                counts["norm_quant"] += 1
            else:
                _unset(norm)
        down = getattr(mlp, "down_proj", None)
        if isinstance(down, Fp8Linear) and fused.silu_mlp(mlp) and (down.act_group is None
                                                                      or down.in_features % fp8_gemm.BLOCK == 0):
            _set(mlp, _silu_quant_mlp_forward, backend)
            counts["silu_quant"] += 1
        else:
            _unset(mlp)
        head_dim = getattr(attn, "head_dim", None)
        if (fp8_pool and type(attn).__name__ in attentions and elementwise.rotary_supports(head_dim)
                and isinstance(getattr(attn, "scaling", None), float) and getattr(attn, "sliding_window", None) is None):
            _set(attn, _q_amax_attention_forward, backend)
            counts["q_amax"] += 1
        else:
            _unset(attn)
    return counts


def uninstall_forwards(model: torch.nn.Module) -> int:
    """Remove every forward :func:`install_forwards` set; returns how many."""
    n = 0
    for module in model.modules():
        if _ours(module) is not None:
            _unset(module)
            n += 1
    return n


def logits_error(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """How far FP8-weight logits ``got`` are from the model-dtype logits ``want`` (same prompts):
    max abs difference, that over max |want|, and the fraction of rows whose argmax agrees."""
    got, want = got.float(), want.float()
    diff = float((got - want).abs().max()) if got.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean()) if got.numel() else 1.0
    return {"max_abs": diff, "rel": diff / scale if scale and math.isfinite(scale) else math.inf,
            "argmax_agreement": agree}


__all__ = [
    "Fp8Linear", "WEIGHT_DTYPES", "ACTIVATION_ATTR", "CheckpointFormat", "checkpoint_format",
    "convert_scale", "decoder_layers", "projection_names", "quantize_model", "fp8_layers", "weight_bytes",
    "weight_dtype_of", "install_forwards", "uninstall_forwards", "logits_error",
]
