"""What one architecture family declares: :class:`ArchitectureSpec`.

A family is a transformers ``model_type`` whose decoder layers have the dense shape the runner
executes (``self_attn`` with ``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``mlp`` with
``gate_proj``/``up_proj``/``down_proj``, ``input_layernorm``/``post_attention_layernorm``),
attention through transformers' attention interface (so ``fpv2_paged`` runs it). What differs
between families, and what every loader and forward used to keep in its own table, is here:

- the transformers classes (config and causal LM: their ``state_dict`` names are the checkpoint's
  tensor names, so the class is the weight mapping), and the class names of a layer's
  attention, MLP and norm (what ``fused`` and ``fp8_linear`` recognise modules by);
- which fused ops fit those modules (``model_executor.fused``) and whether the FP8 pool's q-amax
  attention forward fits (``model_executor.fp8_linear``);
- the tensor-parallel split of each projection (``model_executor.parallel``);
- the projections quantized to FP8 (``model_executor.fp8_linear``);
- the tool-call format of its chat templates (``model_executor.tools``);
- its GGUF ``general.architecture`` name (``model_executor.gguf``).

Classes are named as ``"module:Name"`` strings, imported on first use: the ingress reads the
registry (tool-call formats) and must not import transformers for it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

COLUMN, ROW = "column", "row"
Q_HEADS, KV_HEADS, INTERMEDIATE = "q_heads", "kv_heads", "intermediate"
FUSED_KINDS = ("rms_norm", "silu_mul", "rotary")  # model_executor.fused's kinds
TOOL_CALL_FORMATS = ("hermes", "llama3_json")  # the parsers of model_executor.tools


@dataclass(frozen=True)
class Split:
    """How tensor parallelism cuts one projection: ``parallel`` ``"column"`` (output rows; a bias
    is cut with them) or ``"row"`` (input columns, then an all-reduce; a bias is added once,
    after it), in slices ``by`` ``"q_heads"``, ``"kv_heads"`` (``kv_cache.heads.HeadLayout``'s
    heads of the rank, times head_dim) or ``"intermediate"`` (equal slices of the MLP width)."""

    parallel: str
    by: str

    def __post_init__(self) -> None:
        if self.parallel not in (COLUMN, ROW):
            raise ValueError(f"parallel: expected {COLUMN!r} or {ROW!r}, got {self.parallel!r}")
        if self.by not in (Q_HEADS, KV_HEADS, INTERMEDIATE):
            raise ValueError(f"by: expected one of {(Q_HEADS, KV_HEADS, INTERMEDIATE)}, got {self.by!r}")


@dataclass(frozen=True)
class LayerClasses:
    """transformers class names of a decoder layer's ``self_attn``, ``mlp`` and norms."""

    attention: str
    mlp: str
    norm: str


ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Megatron's split of a dense decoder (model_executor.parallel's module doc says why)
DENSE_TP_SPLIT = (("q_proj", Split(COLUMN, Q_HEADS)), ("k_proj", Split(COLUMN, KV_HEADS)),
                  ("v_proj", Split(COLUMN, KV_HEADS)), ("o_proj", Split(ROW, Q_HEADS)),
                  ("gate_proj", Split(COLUMN, INTERMEDIATE)), ("up_proj", Split(COLUMN, INTERMEDIATE)),
                  ("down_proj", Split(ROW, INTERMEDIATE)))


def _resolve(path: str, name: str) -> Any:
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{name}: cannot import {path!r}: {exc}") from None


@dataclass(frozen=True)
class ArchitectureSpec:
    """One architecture family (see the module doc). ``fused_ops``: the kinds of
    ``model_executor.fused`` that may replace its modules' forwards (``"rotary"`` only where the
    attention forward is exactly projections, rotate-half RoPE, attention, ``o_proj``: no q/k
    norms, no sliding window). ``fp8_attention``: the FP8 pool's q-amax forward fits its
    attention (q/k norms allowed). ``fp8_targets``: the projections FP8 weights go to (empty:
    none). ``tool_call_format``: one of ``TOOL_CALL_FORMATS`` or None (no tool calls).
    ``gguf_architecture``: the GGUF files' ``general.architecture`` of this family, or None.
    ``rotary_embedding``: where the model keeps its RoPE module (rebuilt after a meta-device
    shard load: its buffers are in no checkpoint)."""

    model_type: str
    config_class: str  # "module:Name"
    model_class: str  # "module:Name", a causal LM
    layer: LayerClasses
    fused_ops: frozenset[str]
    fp8_attention: bool
    tool_call_format: str | None
    gguf_architecture: str | None
    attention_projections: tuple[str, ...] = ATTENTION_PROJECTIONS
    mlp_projections: tuple[str, ...] = MLP_PROJECTIONS
    tp_split: tuple[tuple[str, Split], ...] = DENSE_TP_SPLIT
    fp8_targets: tuple[str, ...] = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
    rotary_embedding: str = "model.rotary_emb"
    _splits: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_type, str) or not self.model_type:
            raise ValueError(f"model_type: expected a non-empty str, got {self.model_type!r}")
        for name in ("config_class", "model_class"):
            value = getattr(self, name)
            if not isinstance(value, str) or value.count(":") != 1:
                raise ValueError(f"{name}: expected 'module:Name', got {value!r}")
        if not isinstance(self.fused_ops, frozenset) or not self.fused_ops <= set(FUSED_KINDS):
            raise ValueError(f"fused_ops: expected a frozenset of {FUSED_KINDS}, got {self.fused_ops!r}")
        if self.tool_call_format is not None and self.tool_call_format not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool_call_format: expected one of {TOOL_CALL_FORMATS} or None, got "
                             f"{self.tool_call_format!r}")
        projections = self.attention_projections + self.mlp_projections
        splits = dict(self.tp_split)
        if len(splits) != len(self.tp_split) or not set(splits) <= set(projections):
            raise ValueError(f"tp_split: expected each of the projections {projections} at most once, got "
                             f"{[p for p, _ in self.tp_split]}")
        if not set(self.fp8_targets) <= set(projections):
            raise ValueError(f"fp8_targets: expected projections among {projections}, got {self.fp8_targets}")
        object.__setattr__(self, "_splits", splits)

    def config_cls(self) -> Any:
        """The transformers config class (imported now)."""
        return _resolve(self.config_class, "config_class")

    def model_cls(self) -> Any:
        """The transformers causal-LM class (imported now)."""
        return _resolve(self.model_class, "model_class")

    def split_of(self, projection: str) -> Split | None:
        """The TP split of a projection (its leaf name); None: every rank keeps it whole."""
        return self._splits.get(projection)

    def projection_path(self, projection: str) -> str:
        """``self_attn.<p>`` or ``mlp.<p>``: where a projection sits in a decoder layer."""
        return f"{'self_attn' if projection in self.attention_projections else 'mlp'}.{projection}"
