"""The model registry: ``model_type`` -> :class:`ArchitectureSpec`, one module per family.

Adding an architecture: a module here declaring its ``SPEC`` (``spec.py`` says what), and its
line in ``ARCHITECTURES`` below. The loaders (``loading``, ``gguf``), the fused and FP8 forwards
(``fused``, ``fp8_linear``), tensor parallelism (``parallel``) and tool calling (``tools``) ask
the registry; none keeps a table of its own. A family outside the product (a test's toy) comes in
through :func:`register`.

Only dataclasses are imported here (no torch, no transformers): the ingress reads tool-call
formats from the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import llama, qwen2, qwen3
from .spec import (
    COLUMN,
    FUSED_KINDS,
    INTERMEDIATE,
    KV_HEADS,
    Q_HEADS,
    ROW,
    TOOL_CALL_FORMATS,
    ArchitectureSpec,
    LayerClasses,
    Split,
)

ARCHITECTURES = (llama.SPEC, qwen2.SPEC, qwen3.SPEC)  # one entry per family module
_REGISTRY: dict[str, ArchitectureSpec] = {}


def register(spec: ArchitectureSpec) -> ArchitectureSpec:
    """Add ``spec``; ValueError naming ``model_type`` if one of that name is registered already
    (:func:`unregister` it first)."""
    if not isinstance(spec, ArchitectureSpec):
        raise ValueError(f"spec: expected an ArchitectureSpec, got {type(spec).__name__}")
    if spec.model_type in _REGISTRY:
        raise ValueError(f"model_type: {spec.model_type!r} is registered already")
    _REGISTRY[spec.model_type] = spec
    return spec


def unregister(model_type: str) -> ArchitectureSpec:
    """Remove and return the spec of ``model_type`` (ValueError as :func:`get`)."""
    spec = get(model_type)
    del _REGISTRY[model_type]
    return spec


def supported_model_types() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def specs() -> tuple[ArchitectureSpec, ...]:
    return tuple(_REGISTRY.values())


def get(model_type: object) -> ArchitectureSpec:
    """The spec of ``model_type``; ValueError naming ``model_type`` and listing the supported ones."""
    spec = _REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if spec is None:
        raise ValueError(f"model_type: expected one of {supported_model_types()}, got {model_type!r}")
    return spec


def for_config(config: Any) -> ArchitectureSpec:
    """The spec of a model config (its ``model_type``)."""
    return get(getattr(config, "model_type", None))


def for_gguf(architecture: object) -> ArchitectureSpec:
    """The spec whose GGUF ``general.architecture`` is ``architecture``; ValueError naming it."""
    for spec in _REGISTRY.values():
        if spec.gguf_architecture is not None and spec.gguf_architecture == architecture:
            return spec
    have = tuple(s.gguf_architecture for s in _REGISTRY.values() if s.gguf_architecture is not None)
    raise ValueError(f"general.architecture: expected one of {have}, got {architecture!r}")


def for_layer(layer: Any) -> ArchitectureSpec | None:
    """The spec whose decoder layer ``layer`` is (by its ``self_attn`` and ``mlp`` classes), or None."""
    attn = type(getattr(layer, "self_attn", None)).__name__
    mlp = type(getattr(layer, "mlp", None)).__name__
    for spec in _REGISTRY.values():
        if spec.layer.attention == attn and spec.layer.mlp == mlp:
            return spec
    return None


def decoder_layers(model: Any) -> list[tuple[str, Any]]:
    """``(name, module)`` of every decoder layer of ``model`` (a module with ``self_attn`` and ``mlp``)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]


def layer_classes(part: str, where: Callable[[ArchitectureSpec], bool] | None = None) -> frozenset[str]:
    """Class names of ``part`` (``"attention"``, ``"mlp"``, ``"norm"``) over the registered
    families (those ``where(spec)`` holds for)."""
    return frozenset(getattr(s.layer, part) for s in _REGISTRY.values() if where is None or where(s))


def tool_call_formats() -> dict[str, str]:
    """``model_type -> tool-call format`` of the families that have one."""
    return {t: s.tool_call_format for t, s in _REGISTRY.items() if s.tool_call_format is not None}


for _spec in ARCHITECTURES:
    register(_spec)

__all__ = [
    "ARCHITECTURES", "COLUMN", "ROW", "Q_HEADS", "KV_HEADS", "INTERMEDIATE", "FUSED_KINDS", "TOOL_CALL_FORMATS",
    "ArchitectureSpec", "LayerClasses", "Split", "register", "unregister", "supported_model_types", "specs", "get",
    "for_config", "for_gguf", "for_layer", "decoder_layers", "layer_classes", "tool_call_formats",
]
