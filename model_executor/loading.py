"""Model loading: a local Hugging Face directory, or one of the built-in models.

Local directories are read with Hugging Face offline semantics: only files in the directory,
never the network (``local_files_only=True``; a path, not a hub id). Before transformers
touches them, every file is checked, so a broken directory fails with a ``FileNotFoundError``
or ``ValueError`` naming the file (and the tensor or field) at fault.

Supported architectures: Llama (3.x included), Qwen2, Qwen3 (full-attention layers).

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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .tokenizer import ByteTokenizer, HFTokenizer, IdTokenizer

BUILTIN_TINY = "builtin:tiny"
BUILTIN_STRUCTURED_8B = "builtin:structured-8b"
BUILTIN_STRUCTURED_TINY = "builtin:structured-tiny"
BUILTIN_MODELS = (BUILTIN_TINY, BUILTIN_STRUCTURED_8B, BUILTIN_STRUCTURED_TINY)
_BUILTIN_PREFIX = "builtin:"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
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
        max_position_embeddings=32768,
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


def structured_spec(name: str, seed: int = 0) -> Any:
    """The ``model_executor.structured_model`` spec of a built-in structured model."""
    from .structured_model import llama31_8b_spec, tiny_spec

    if name == BUILTIN_STRUCTURED_8B:
        return llama31_8b_spec(seed=seed)
    if name == BUILTIN_STRUCTURED_TINY:
        return tiny_spec(seed=seed)
    raise ValueError(f"name: expected {BUILTIN_STRUCTURED_8B!r} or {BUILTIN_STRUCTURED_TINY!r}, got {name!r}")


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


def builtin_tokenizer(name: str) -> Any:
    """The tokenizer of a built-in model, without building its weights (the ingress)."""
    if name == BUILTIN_TINY:
        return ByteTokenizer()
    spec = structured_spec(name)
    return IdTokenizer(spec.vocab_size, bos_token_id=spec.bos_token_id)


def check_model_name(source: str) -> None:
    """``builtin:...`` names must be one of ``BUILTIN_MODELS`` (anything else is a directory)."""
    if str(source).startswith(_BUILTIN_PREFIX) and str(source) not in BUILTIN_MODELS:
        raise ValueError(f"model: expected one of {BUILTIN_MODELS} or a model directory, got {str(source)!r}")


def load_tokenizer(source: str | Path) -> Any:
    """The tokenizer alone: a built-in model's, or a local directory's (offline)."""
    check_model_name(str(source))
    if str(source) in BUILTIN_MODELS:
        return builtin_tokenizer(str(source))
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(source), local_files_only=True))


def _read_json(path: Path) -> Any:
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


def _check_config(model_dir: Path) -> dict:
    raw = _read_json(model_dir / "config.json")
    if not isinstance(raw, dict):
        raise ValueError(f"config.json: expected a JSON object in {model_dir}, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type: expected one of {SUPPORTED_MODEL_TYPES}, got {model_type!r} "
            f"(in {model_dir})"
        )
    return raw


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index.name}: expected a non-empty 'weight_map' object in {index}")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise FileNotFoundError(
                    f"{f.name}: listed in {index.name} but missing from {model_dir}"
                )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in model_dir.glob("*.bin"))
        hint = f" (found {other}: convert them to safetensors)" if other else ""
        raise FileNotFoundError(
            f"model.safetensors: expected *.safetensors weights (or model.safetensors.index.json) "
            f"in {model_dir}, found none{hint}"
        )
    return files


def _check_weights(model_dir: Path, files: list[Path], config: Any) -> None:
    """Every tensor of the model is present once, with the shape the config implies."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    found: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    found[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises its own error types on a bad header
            raise ValueError(f"{f.name}: expected a valid safetensors file ({f}), got: {e}") from None
    for name, shape in found.items():
        want = expected.get(name)
        if want is not None and want != shape:
            raise ValueError(
                f"{_file_of(name, files)}: tensor {name}: expected shape {list(want)} "
                f"(from config.json), got {list(shape)}"
            )
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [n for n in expected if n not in found and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(
            f"model.safetensors: expected {len(expected)} tensors in {model_dir}, "
            f"missing {len(missing)}: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )


def _file_of(name: str, files: list[Path]) -> str:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            if name in handle.keys():
                return f.name
    return files[0].name


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
            _read_json(model_dir / name)


def load_model_dir(
    model_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Load a local Hugging Face model directory (config.json, *.safetensors, tokenizer).

    ``dtype`` defaults to the checkpoint's ``torch_dtype``/``dtype`` (float32 if absent).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model_dir: expected a directory, got {str(path)!r} (not found)")
    _check_config(path)
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"config.json: transformers cannot build a config from {path}: {e}") from None
    files = _weight_files(path)
    _check_weights(path, files, config)
    if load_tokenizer:
        _check_tokenizer(path)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, dtype=dtype, attn_implementation=attn_implementation
    )
    model = model.to(device).eval()
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
) -> LoadedModel:
    """``None`` or ``"builtin:tiny"``: the built-in tiny model; ``"builtin:structured-8b"`` /
    ``"builtin:structured-tiny"``: a structured benchmark model (default dtype bfloat16);
    otherwise a local directory."""
    if source is None or str(source) == BUILTIN_TINY:
        return build_tiny_model(dtype=dtype or torch.float32, device=device, seed=seed)
    check_model_name(str(source))
    if str(source) in (BUILTIN_STRUCTURED_8B, BUILTIN_STRUCTURED_TINY):
        return build_structured_model(str(source), dtype=dtype or torch.bfloat16, device=device, seed=seed)
    return load_model_dir(source, dtype=dtype, device=device)


def make_pool(loaded: LoadedModel, *, num_pages: int, page_size: int = 64, dtype=None, device=None):
    """A KV pool shaped for ``loaded`` (dtype and device of the model by default)."""
    from kv_transfer.pool import KVPool, KVPoolConfig

    param = next(loaded.model.parameters())
    return KVPool(
        KVPoolConfig(
            num_layers=loaded.num_layers,
            num_kv_heads=loaded.num_kv_heads,
            head_dim=loaded.head_dim,
            page_size=page_size,
            dtype=dtype or param.dtype,
            device=str(device or param.device),
            num_pages=num_pages,
        )
    )
