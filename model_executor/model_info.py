"""What a model is, read without its weights and without torch: the built-in models' names,
the context a model serves (:func:`model_context`), its ``model_type``, its tokenizer and the
loader's ``weight_dtype`` values. The
ingress needs these and nothing else of the model; its process never imports torch
(tests/test_ingress_imports.py). ``model_executor.loading`` re-exports every name here.

The built-in structured models' specs live in ``model_executor.structured_spec`` (torch-free;
``model_executor.structured_model`` builds their weights).
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import gguf
from .gguf import BUILTIN_SMOLLM2
from .tokenizer import ByteTokenizer, HFTokenizer, IdTokenizer

BUILTIN_TINY = "builtin:tiny"
BUILTIN_STRUCTURED_8B = "builtin:structured-8b"
BUILTIN_STRUCTURED_TINY = "builtin:structured-tiny"
BUILTIN_STRUCTURED_32B = "builtin:structured-32b"  # Qwen2.5-32B's shape (GPU; TP for long prompts)
BUILTIN_STRUCTURED_70B = "builtin:structured-70b"  # Llama-3.1-70B's shape (GPU, TP >= 2 in bf16)
BUILTIN_STRUCTURED = (BUILTIN_STRUCTURED_8B, BUILTIN_STRUCTURED_TINY, BUILTIN_STRUCTURED_32B, BUILTIN_STRUCTURED_70B)
BUILTIN_MODELS = (BUILTIN_SMOLLM2, BUILTIN_TINY, *BUILTIN_STRUCTURED)
DEFAULT_MODEL = BUILTIN_SMOLLM2
_BUILTIN_PREFIX = "builtin:"
TINY_MAX_POSITIONS = 32768  # the built-in tiny model's context (tiny_config's max_position_embeddings)
# the loader's weight_dtype values and the scheme each one quantizes to (None: as stored)
WEIGHT_DTYPES = {"auto": None, "fp8_e4m3": "channel", "fp8_tensor": "tensor", "fp8_channel": "channel",
                 "fp8_block": "block"}


def read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path.name}: expected the file {path}, it does not exist") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path.name}: expected valid JSON in {path}, got a parse error at line {e.lineno} "
            f"column {e.colno}: {e.msg}"
        ) from None


def structured_spec(name: str, seed: int = 0) -> Any:
    """The ``model_executor.structured_spec`` spec of a built-in structured model."""
    from .structured_spec import llama31_8b_spec, llama31_70b_spec, qwen25_32b_spec, tiny_spec

    specs = {BUILTIN_STRUCTURED_8B: llama31_8b_spec, BUILTIN_STRUCTURED_TINY: tiny_spec,
             BUILTIN_STRUCTURED_32B: qwen25_32b_spec, BUILTIN_STRUCTURED_70B: llama31_70b_spec}
    if name not in specs:
        raise ValueError(f"name: expected one of {BUILTIN_STRUCTURED}, got {name!r}")
    return specs[name](seed=seed)


def config_fields(source: str | Path) -> Any | None:
    """A directory's config.json (its ``text_config`` where it has one) as attributes, with
    ``num_key_value_heads`` defaulted; ``None`` without the file or without integer
    ``num_attention_heads``, ``hidden_size`` and ``intermediate_size`` (``load_model_dir`` names
    what is wrong)."""
    path = Path(source) / "config.json"
    if not path.is_file():
        return None
    raw = read_json(path)
    raw = raw.get("text_config", raw) if isinstance(raw, dict) else {}
    if not all(isinstance(raw.get(k), int) for k in ("num_attention_heads", "hidden_size", "intermediate_size")):
        return None
    raw.setdefault("num_key_value_heads", raw["num_attention_heads"])
    return types.SimpleNamespace(**raw)


def model_type(source: str | Path) -> str | None:
    """config.json's ``model_type`` of ``source`` (what a chat template's tool-call format
    depends on) without its weights and, for the built-in models, without transformers: the
    ingress asks, and importing transformers would cost it seconds of start-up for one string.
    ``None`` for a directory not here or whose config.json names none."""
    check_model_name(str(source))
    if str(source) == BUILTIN_TINY or str(source) in BUILTIN_STRUCTURED:
        return "llama"  # tiny_config() and structured_model.llama_config() are LlamaConfigs
    if str(source) == BUILTIN_SMOLLM2 or gguf.is_gguf_path(source):
        source = gguf.gguf_dir(source)
    value = getattr(config_fields(source), "model_type", None)
    return value if isinstance(value, str) else None


def builtin_tokenizer(name: str) -> Any:
    """The tokenizer of a built-in model, without building its weights (the ingress)."""
    if name == BUILTIN_TINY:
        return ByteTokenizer()
    if name == BUILTIN_SMOLLM2:
        return load_tokenizer(name)
    spec = structured_spec(name)
    return IdTokenizer(spec.vocab_size, bos_token_id=spec.bos_token_id)


def check_model_name(source: str) -> None:
    """``builtin:...`` names must be one of ``BUILTIN_MODELS`` (anything else is a directory)."""
    if str(source).startswith(_BUILTIN_PREFIX) and str(source) not in BUILTIN_MODELS:
        raise ValueError(f"model: expected one of {BUILTIN_MODELS} or a model directory, got {str(source)!r}")


def load_tokenizer(source: str | Path) -> Any:
    """The tokenizer alone: a built-in model's, or a local directory's (offline)."""
    check_model_name(str(source))
    if str(source) == BUILTIN_SMOLLM2 or gguf.is_gguf_path(source):
        source = gguf.gguf_dir(source)
    elif str(source) in BUILTIN_MODELS:
        return builtin_tokenizer(str(source))
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(source), local_files_only=True))


ROPE_SCALING_TYPES = ("linear", "yarn")


def check_rope_scaling(rope_scaling: object) -> dict:
    """``{"rope_type": "linear" | "yarn", "factor": f}`` with f > 1, or a ValueError naming
    ``rope_scaling``."""
    if not isinstance(rope_scaling, dict) or set(rope_scaling) != {"rope_type", "factor"}:
        raise ValueError(f"rope_scaling: expected {{'rope_type': ..., 'factor': ...}}, got {rope_scaling!r}")
    kind, factor = rope_scaling["rope_type"], rope_scaling["factor"]
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope_scaling: rope_type: expected one of {ROPE_SCALING_TYPES}, got {kind!r}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1.0:
        raise ValueError(f"rope_scaling: factor: expected a number > 1, got {factor!r}")
    return rope_scaling


def rope_scaling_overrides(raw: dict, rope_scaling: dict) -> dict:
    """Config overrides that stretch a model's RoPE beyond its trained context:
    ``rope_scaling = {"rope_type": "linear" | "yarn", "factor": f}`` (f > 1) becomes
    transformers' ``rope_parameters`` (the trained theta kept; YaRN's
    ``original_max_position_embeddings`` the trained context) and ``max_position_embeddings``
    times ``f``. ``raw``: the directory's config.json, whose RoPE must be unscaled."""
    kind, factor = check_rope_scaling(rope_scaling)["rope_type"], rope_scaling["factor"]
    base = raw.get("rope_parameters") or {}
    legacy = raw.get("rope_scaling") or {}
    if base.get("rope_type", "default") != "default" or legacy.get("rope_type", legacy.get("type", "default")) != "default":
        raise ValueError(f"rope_scaling: the model's RoPE is already scaled ({base or legacy}); cannot stack another")
    theta = base.get("rope_theta", raw.get("rope_theta"))
    trained = raw.get("max_position_embeddings")
    if not isinstance(theta, (int, float)) or not isinstance(trained, int):
        raise ValueError("rope_scaling: config.json has no rope_theta / max_position_embeddings to scale")
    params = {"rope_type": kind, "factor": float(factor), "rope_theta": float(theta)}
    if kind == "yarn":
        params["original_max_position_embeddings"] = trained
    return {"rope_parameters": params, "max_position_embeddings": int(round(trained * factor))}


@dataclass(frozen=True)
class ModelContext:
    """A model's context limit: ``tokens`` positions, ``source`` says where the number comes
    from; ``trained``: whether the model was trained to it (False for the constructed structured
    models, which have no trained context to stay within)."""

    tokens: int
    source: str
    trained: bool = True


def context_of_config(raw: dict) -> ModelContext | None:
    """The context a config.json's fields give, as vLLM derives it: ``max_position_embeddings``,
    or with a stretching RoPE (``rope_scaling`` / ``rope_parameters`` of type ``yarn``, ``linear``
    or ``dynamic``) the factor times the original context (YaRN's
    ``original_max_position_embeddings`` where given). Types whose ``max_position_embeddings``
    already is the stretched context (``llama3``, ``longrope``) keep it. None without a number."""
    trained = raw.get("max_position_embeddings")
    if isinstance(trained, bool) or not isinstance(trained, int) or trained < 1:
        return None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if kind in ("yarn", "linear", "dynamic") and isinstance(factor, (int, float)) and factor > 1:
        base = rope.get("original_max_position_embeddings") if kind == "yarn" else None
        base = base if isinstance(base, int) and base > 0 else trained
        return ModelContext(int(base * factor), f"{kind} RoPE scaling: {base} x factor {factor:g}")
    return ModelContext(trained, f"max_position_embeddings of its config.json ({trained})")


def model_context(source: str | Path, rope_scaling: dict | None = None) -> ModelContext | None:
    """The context ``source`` serves (vLLM's default ``max_model_len``), from its config alone
    (no weights; no transformers for the built-in models): the built-in tiny model's
    ``TINY_MAX_POSITIONS``, a structured model's ``max_position_embeddings``, a directory's (or
    a GGUF model's converted) config.json by :func:`context_of_config`; with ``rope_scaling``
    (:func:`rope_scaling_overrides`) the stretched context. None for a directory not here."""
    check_model_name(str(source))
    if rope_scaling is not None and (str(source) == BUILTIN_TINY or str(source) in BUILTIN_STRUCTURED):
        raise ValueError(f"rope_scaling: only model directories (and {BUILTIN_SMOLLM2}) take it, got {str(source)!r}")
    if str(source) == BUILTIN_TINY:
        return ModelContext(TINY_MAX_POSITIONS, f"max_position_embeddings of {BUILTIN_TINY} ({TINY_MAX_POSITIONS})")
    if str(source) in BUILTIN_STRUCTURED:
        n = structured_spec(str(source)).max_position_embeddings
        return ModelContext(n, f"max_position_embeddings of {source} ({n})", trained=False)
    path = (gguf.gguf_dir(source) if str(source) == BUILTIN_SMOLLM2 or gguf.is_gguf_path(source) else Path(source))
    if not (path / "config.json").is_file():
        return None
    raw = read_json(path / "config.json")
    raw = raw.get("text_config", raw) if isinstance(raw, dict) else {}
    if rope_scaling is not None:
        stretched = rope_scaling_overrides(raw, rope_scaling)["max_position_embeddings"]
        return ModelContext(stretched, f"{rope_scaling['rope_type']} RoPE scaling: {raw['max_position_embeddings']} "
                                       f"x factor {rope_scaling['factor']:g}")
    return context_of_config(raw)
