"""Model loading: a local Hugging Face directory, or one of the built-in models.

Local directories are read with Hugging Face offline semantics: only files in the directory,
never the network (``local_files_only=True``; a path, not a hub id). Before transformers
touches them, every file is checked, so a broken directory fails with a ``FileNotFoundError``
or ``ValueError`` naming the file (and the tensor or field) at fault.

Supported architectures: the families of ``model_executor.models`` (Llama, 3.x included; Qwen2;
Qwen3; full-attention layers), by config.json's ``model_type``; the model is built from its
family's transformers class. The safetensors readers are ``model_executor.checkpoint``.

FP8 weights (``model_executor/fp8_linear.py``): a directory whose config.json has a
``quantization_config`` (Hugging Face ``quant_method: "fp8"``, per tensor or 128x128 blocks;
compressed-tensors FP8, per channel, per tensor or 128x128 blocks) loads its projections as
``Fp8Linear`` from the stored e4m3 weights and scales (every tensor checked first: a missing or
misshapen scale, an FP8 tensor outside the projections or an unknown ``quant_method`` is a
``ValueError`` naming it). ``weight_dtype`` (``fp8_tensor``, ``fp8_channel``, ``fp8_block``;
``fp8_e4m3`` = ``fp8_channel``) quantizes a model stored in a float dtype (a directory or a built-in
model) on load; ``auto`` (default) keeps what is stored.

The built-in model (``BUILTIN_TINY``) needs no files at all: a Llama-shaped model,
randomly initialised from a fixed seed, with our byte-level tokenizer:
4 layers, hidden 256, MLP 512, 8 query heads and 2 KV heads of head_dim 64 (GQA 4),
vocabulary 264 (256 bytes + specials, see ``ByteTokenizer``), RoPE theta 10000,
32768 positions, untied embeddings, init std 0.1 (seed 0 by default). Its weights are random: its text is gibberish, but its
numerics exercise every code path.

The built-in structured models (``BUILTIN_STRUCTURED_8B``, ``BUILTIN_STRUCTURED_TINY``) are the
benchmark models of ``model_executor.structured_model``: Llama-3.1-8B's shape (or its CPU-sized tiny
spec) with weights constructed so that heads show sinks, locality and retrieval, so FlashPrefill
selects about as much as on the real model. They are built on the replica's own device, from
``seed`` alone (the constructed weights from the spec's seed, the rest of transformers' init
from the global RNG seeded the same way, under a forked RNG): every replica, on any GPU, holds
the same weights. They have no text vocabulary: prompts are token ids (``IdTokenizer``), and
without a stop token they always generate ``max_tokens`` tokens.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, fp8_linear, gguf, models, parallel
from .checkpoint import fp8_scale_slice  # noqa: F401 - loading's public name
from .gguf import BUILTIN_SMOLLM2
# what a model is, read without torch (the ingress's part), re-exported: loading is the public API
from .model_info import (  # noqa: F401
    BUILTIN_MODELS,
    BUILTIN_STRUCTURED,
    BUILTIN_STRUCTURED_8B,
    BUILTIN_STRUCTURED_32B,
    BUILTIN_STRUCTURED_70B,
    BUILTIN_STRUCTURED_TINY,
    BUILTIN_TINY,
    DEFAULT_MODEL,
    ROPE_SCALING_TYPES,
    TINY_MAX_POSITIONS,
    ModelContext,
    builtin_tokenizer,
    check_model_name,
    check_rope_scaling,
    config_fields,
    context_of_config,
    load_tokenizer,
    model_context,
    model_type,
    read_json,
    rope_scaling_overrides,
    structured_spec,
)
from .tokenizer import ByteTokenizer, HFTokenizer, IdTokenizer, byte_tokenizer_hf

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM (eval mode) with its tokenizer and a display name."""

    name: str
    model: Any
    tokenizer: Any
    config: Any

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.num_key_value_heads)

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank's pool holds (``num_kv_heads`` unless the model is TP-sharded)."""
        shard = parallel.shard_of(self.model)
        return self.num_kv_heads if shard is None else shard.layout.local_kv_heads

    @property
    def head_dim(self) -> int:
        c = self.config
        return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


def tiny_config(num_layers: int = 4) -> Any:
    """The built-in model's ``LlamaConfig`` (see the module docstring)."""
    from transformers import LlamaConfig

    tok = ByteTokenizer()
    return LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=TINY_MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        # 0.1 rather than transformers' 0.02: at 0.02 a random model repeats one token forever,
        # which would make the token-equality tests vacuous
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def build_tiny_model(
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    num_layers: int = 4,
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """The built-in tiny model; the same ``seed`` gives the same weights on every device."""
    from transformers import LlamaForCausalLM

    config = tiny_config(num_layers)
    config._attn_implementation = attn_implementation
    # Initialise on the CPU in fp32 under a forked RNG: same weights everywhere, and the
    # caller's global RNG state is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model = model.to(device=device, dtype=dtype).eval()
    return LoadedModel(name=BUILTIN_TINY, model=model, tokenizer=ByteTokenizer(), config=model.config)


def build_structured_model(
    name: str = BUILTIN_STRUCTURED_TINY,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """A built-in structured benchmark model (see the module docstring), built on ``device``
    in ``dtype``; the same ``seed`` gives the same weights on every device of one kind."""
    from .structured_model import build_structured_llama

    spec = structured_spec(name, seed)
    device = torch.device(device)
    forked = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        torch.manual_seed(seed)
        model = build_structured_llama(spec, device=device, dtype=dtype)
    tokenizer = IdTokenizer(spec.vocab_size, bos_token_id=spec.bos_token_id)
    return LoadedModel(name=name, model=model.eval(), tokenizer=tokenizer, config=model.config)


def model_shape(source: str | Path) -> Any | None:
    """The head counts and widths of ``source`` (``num_attention_heads``, ``num_key_value_heads``,
    ``head_dim``, ``intermediate_size``, ...) without its weights: a built-in model's config, or
    a directory's config.json; ``None`` for a directory not here (checked where it loads)."""
    check_model_name(str(source))
    if str(source) == BUILTIN_TINY:
        return tiny_config()
    if str(source) == BUILTIN_SMOLLM2 or gguf.is_gguf_path(source):
        source = gguf.gguf_dir(source)
    if str(source) in BUILTIN_STRUCTURED:
        from .structured_model import llama_config

        return llama_config(structured_spec(str(source)))
    return config_fields(source)


# what a Hugging Face tokenizer directory may hold (weights and model config are not copied)
_TOKENIZER_EXPORT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                           "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                           "vocab.txt")


def export_tokenizer(source: str | Path, out: str | Path) -> Path:
    """Write the tokenizer of ``source`` (a model the service can serve) as a Hugging Face
    directory ``out`` that ``AutoTokenizer.from_pretrained(out)`` loads and that tokenizes as the
    service does, for clients that count or build tokens themselves (lm-eval's ``tokenizer=``,
    guidellm's ``--processor``). A Hugging Face or GGUF model's tokenizer files are copied as they
    are; ``builtin:tiny`` gets ``byte_tokenizer_hf``; the structured models have no text
    vocabulary: ``ValueError`` naming ``model``. Returns ``out``."""
    import shutil

    check_model_name(str(source))
    if str(source) in BUILTIN_STRUCTURED:
        raise ValueError(f"model: {source} has no text vocabulary (its prompts are token ids), so it has no "
                         "tokenizer to export; send token ids instead")
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: expected a directory (created if missing), got the file {str(out)!r}")
    if str(source) == BUILTIN_TINY:
        out.mkdir(parents=True, exist_ok=True)
        byte_tokenizer_hf().save_pretrained(str(out))
        return out
    src = gguf.gguf_dir(source) if str(source) == BUILTIN_SMOLLM2 or gguf.is_gguf_path(source) else Path(source)
    if not src.is_dir():
        raise ValueError(f"model: expected one of {BUILTIN_MODELS}, a .gguf file or a model directory, got {str(source)!r}")
    _check_tokenizer(src)
    if out.exists() and out.resolve() == src.resolve():
        raise ValueError(f"out: expected a directory other than the model's own, got {str(out)!r}")
    out.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_EXPORT_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    _no_bpe_cleanup(out)
    return out


def _no_bpe_cleanup(tokenizer_dir: Path) -> None:
    """``clean_up_tokenization_spaces: false`` in the tokenizer_config.json of a BPE tokenizer
    that says true: transformers ignores it for BPE (the clean-up would strip spaces before
    punctuation) and warns on every first decode of each process (the server, lm-eval, guidellm);
    false decodes the same, silently."""
    config_path, tokenizer_path = tokenizer_dir / "tokenizer_config.json", tokenizer_dir / "tokenizer.json"
    if not config_path.is_file() or not tokenizer_path.is_file():
        return
    config = read_json(config_path)
    model = (read_json(tokenizer_path).get("model") or {}).get("type")
    if model == "BPE" and config.get("clean_up_tokenization_spaces") is True and \
            not config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"):
        config["clean_up_tokenization_spaces"] = False
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_config(model_dir: Path) -> tuple[dict, models.ArchitectureSpec]:
    """config.json of ``model_dir`` and its family; ValueError naming ``config.json: model_type``
    (with the supported ones) for a family not registered."""
    raw = read_json(model_dir / "config.json")
    if not isinstance(raw, dict):
        raise ValueError(f"config.json: expected a JSON object in {model_dir}, got {type(raw).__name__}")
    try:
        spec = models.get(raw.get("model_type"))
    except ValueError as e:
        raise ValueError(f"config.json: {e} (in {model_dir})") from None
    return raw, spec


def _check_tokenizer(model_dir: Path) -> None:
    present = [n for n in _TOKENIZER_FILES if (model_dir / n).exists()]
    bpe_pair = (model_dir / "vocab.json").exists() and (model_dir / "merges.txt").exists()
    if not present and not bpe_pair:
        raise FileNotFoundError(
            f"tokenizer.json: expected tokenizer files in {model_dir} (tokenizer.json, "
            "tokenizer.model, or vocab.json + merges.txt), found none"
        )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).exists():
            read_json(model_dir / name)


def check_weight_dtype(weight_dtype: object) -> str | None:
    """The ``fp8_gemm`` scheme ``weight_dtype`` quantizes to (``None``: as stored)."""
    if weight_dtype not in fp8_linear.WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype: expected one of {tuple(fp8_linear.WEIGHT_DTYPES)}, got {weight_dtype!r}")
    return fp8_linear.WEIGHT_DTYPES[weight_dtype]


def _quantize_loaded(model: Any, weight_dtype: str) -> None:
    scheme = check_weight_dtype(weight_dtype)
    if scheme is not None:
        fp8_linear.quantize_model(model, scheme)


def load_model_dir(
    model_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
    attn_implementation: str = "sdpa",
    weight_dtype: str = "auto",
    tp: "parallel.TensorParallel | None" = None,
    rope_scaling: dict | None = None,
) -> LoadedModel:
    """Load a local Hugging Face model directory (config.json, *.safetensors, tokenizer).

    ``rope_scaling``: run the model beyond its trained context (:func:`rope_scaling_overrides`).

    ``tp``: load only rank ``tp.rank``'s shard (``model_executor.parallel``): each tensor's slice
    is read from the file, no rank ever holds another rank's projections (float checkpoints,
    which ``weight_dtype`` then quantizes shard by shard; FP8 checkpoints read each e4m3 weight
    slice with the matching slice of its scale: :func:`fp8_scale_slice`).

    ``dtype`` defaults to the checkpoint's ``torch_dtype``/``dtype`` (float32 if absent); for
    FP8 checkpoints it is the dtype of everything but the FP8 weights (bfloat16 if absent).
    ``weight_dtype``: see the module doc (an FP8 checkpoint loads as stored; naming another
    scheme than the stored one is a ValueError).
    """
    from transformers import AutoTokenizer

    scheme = check_weight_dtype(weight_dtype)
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model_dir: expected a directory, got {str(path)!r} (not found)")
    raw, spec = _check_config(path)
    fmt = fp8_linear.checkpoint_format(raw["quantization_config"]) if raw.get("quantization_config") else None
    if fmt is not None and weight_dtype not in ("auto", "fp8_e4m3") and scheme != fmt.scheme:
        raise ValueError(f"weight_dtype: {weight_dtype!r} asks for the {scheme} scheme, but {path} stores FP8 "
                         f"weights with {fmt.scheme} scales ({fmt.quant_method}); use 'auto'")
    overrides = rope_scaling_overrides(raw, rope_scaling) if rope_scaling is not None else {}
    try:
        config = spec.config_cls().from_pretrained(str(path), local_files_only=True, **overrides)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"config.json: transformers cannot build a config from {path}: {e}") from None
    if hasattr(config, "quantization_config"):  # we load the FP8 tensors; transformers' quantizers must not
        delattr(config, "quantization_config")
    files = checkpoint.weight_files(path)
    checkpoint.check_weights(path, files, config)
    if load_tokenizer:
        _check_tokenizer(path)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if dtype is None or dtype == torch.float8_e4m3fn:
            dtype = torch.bfloat16 if fmt is not None else torch.float32
    if tp is not None and tp.size > 1 and fmt is not None:
        model = checkpoint.load_fp8_shard(path, config, files, fmt, dtype, device, attn_implementation, tp).eval()
    elif tp is not None and tp.size > 1:
        model = checkpoint.load_shard(path, config, files, dtype, device, attn_implementation, tp).eval()
        _quantize_loaded(model, weight_dtype)
        parallel.install_reductions(model)
    elif fmt is not None:
        model = checkpoint.load_fp8_dir(path, config, files, fmt, dtype, device, attn_implementation).eval()
    else:
        model = spec.model_cls().from_pretrained(
            str(path), config=config, local_files_only=True, dtype=dtype, attn_implementation=attn_implementation
        )
        model = model.to(device).eval()
        _quantize_loaded(model, weight_dtype)
    tokenizer = None
    if load_tokenizer:
        try:
            tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
        except (OSError, ValueError) as e:
            raise ValueError(f"tokenizer.json: cannot load the tokenizer from {path}: {e}") from None
    return LoadedModel(name=str(path), model=model, tokenizer=tokenizer, config=model.config)


def load_model(
    source: str | Path | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    weight_dtype: str = "auto",
    tp: "parallel.TensorParallel | None" = None,
    rope_scaling: dict | None = None,
) -> LoadedModel:
    """``rope_scaling``: directories and ``builtin:smollm2-135m`` only (:func:`load_model_dir`).
    ``tp``: rank ``tp.rank``'s shard (``model_executor.parallel``; directories read only the
    shard, built-in models are built whole from their seed, then cut). ``None`` or ``"builtin:tiny"``: the built-in tiny model; ``"builtin:structured-8b"`` /
    ``"builtin:structured-tiny"``: a structured benchmark model (default dtype bfloat16);
    otherwise a local directory. ``weight_dtype``: ``"auto"`` (as stored), or an FP8 scheme the
    projections are quantized to on load (see the module doc)."""
    check_weight_dtype(weight_dtype)
    directory = source is not None and str(source) != BUILTIN_TINY and str(source) not in BUILTIN_STRUCTURED
    if rope_scaling is not None and not directory:
        raise ValueError(f"rope_scaling: only model directories (and {BUILTIN_SMOLLM2}) take it, got {source!r}")
    if source is None or str(source) == BUILTIN_TINY:
        loaded = build_tiny_model(dtype=dtype or torch.float32, device=device, seed=seed)
    else:
        check_model_name(str(source))
        if str(source) == BUILTIN_SMOLLM2 or gguf.is_gguf_path(source):
            loaded = load_model_dir(gguf.gguf_dir(source), dtype=dtype, device=device, weight_dtype=weight_dtype, tp=tp,
                                    rope_scaling=rope_scaling)
            return dataclasses.replace(loaded, name=str(source))
        if str(source) not in BUILTIN_STRUCTURED:
            return load_model_dir(source, dtype=dtype, device=device, weight_dtype=weight_dtype, tp=tp,
                                  rope_scaling=rope_scaling)
        loaded = build_structured_model(str(source), dtype=dtype or torch.bfloat16, device=device, seed=seed)
    _quantize_loaded(loaded.model, weight_dtype)  # before sharding: the shards keep the TP=1 scales
    if tp is not None and tp.size > 1:
        parallel.shard_model(loaded.model, tp)
    return loaded


def make_pool(loaded: LoadedModel, *, num_pages: int, page_size: int = 64, dtype=None, device=None):
    """A KV pool shaped for ``loaded`` (dtype and device of the model by default)."""
    from kv_cache import KVPool, KVPoolConfig

    param = next(loaded.model.parameters())
    return KVPool(
        KVPoolConfig(
            num_layers=loaded.num_layers,
            num_kv_heads=loaded.local_kv_heads,
            head_dim=loaded.head_dim,
            page_size=page_size,
            dtype=dtype or param.dtype,
            device=str(device or param.device),
            num_pages=num_pages,
        )
    )
