"""Reading safetensors checkpoints into a model: the checks before any read (every tensor
present with its config's shape; an FP8 checkpoint's e4m3 weights and scales), a whole FP8
checkpoint, and one rank's shard of a float or FP8 checkpoint (only its slices are read). The
model is built from its family's class (``model_executor.models``); ``loading.load_model_dir``
decides which reader runs. Every error names the file and the tensor or field at fault.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import fp8_linear, models, parallel
from .model_info import read_json


def _build(config: Any, **kwargs: Any) -> Any:
    """The model of ``config``'s family (random init), as ``AutoModelForCausalLM.from_config``."""
    return models.for_config(config).model_cls()._from_config(config, **kwargs)


def _rebuild_rotary(model: Any, device: torch.device) -> None:
    """Non-persistent buffers (RoPE's inv_freq) are in no checkpoint: a model materialised from
    the meta device gets its rotary module built again, on ``device``."""
    path = models.for_config(model.config).rotary_embedding
    rotary = model.get_submodule(path)
    with torch.device(device):
        model.set_submodule(path, type(rotary)(config=model.config))


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
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


def check_weights(model_dir: Path, files: list[Path], config: Any) -> None:
    """Every tensor of the model is present once, with the shape the config implies."""
    from safetensors import safe_open
    with torch.device("meta"):
        skeleton = _build(config)
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



_SAFETENSORS_FP8 = "F8_E4M3"


def fp8_headers(files: list[Path], fmt: "fp8_linear.CheckpointFormat", skeleton: Any) -> dict[str, tuple[int, int]]:
    """Check an FP8 checkpoint's tensors from the safetensors headers (no data read): every e4m3
    tensor is a projection's weight, each has its scale, of the shape ``fmt`` gives. Returns the
    FP8 projections ``{module: (out, in)}``."""
    from safetensors import safe_open

    projections = {name: skeleton.get_submodule(name) for name in fp8_linear.projection_names(skeleton)}
    headers: dict[str, tuple[str, list[int], str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                sl = handle.get_slice(name)
                headers[name] = (sl.get_dtype(), list(sl.get_shape()), f.name)
    found: dict[str, tuple[int, int]] = {}
    for name, (dt, shape, fname) in headers.items():
        if dt.startswith("F8_") and dt != _SAFETENSORS_FP8 and not name.endswith("_scale") \
                and not name.endswith("_scale_inv"):
            raise ValueError(f"{fname}: tensor {name}: expected float8_e4m3fn FP8 weights, got {dt}")
        if dt != _SAFETENSORS_FP8:
            continue
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module not in projections:
            raise ValueError(
                f"{fname}: tensor {name}: FP8 (float8_e4m3fn) weights are supported in the projections "
                f"{models.for_config(skeleton.config).fp8_targets} of the decoder layers only; embeddings, "
                "norms and lm_head must be stored in a float dtype")
        found[module] = tuple(shape)
    if not found:
        raise ValueError(f"config.json: quantization_config: quant_method {fmt.quant_method!r} says FP8, but no "
                         f"tensor of {[f.name for f in files]} is float8_e4m3fn")
    for module, (n, k) in found.items():
        scale = fmt.scale_name(module)
        if scale not in headers:
            raise ValueError(f"{headers[module + '.weight'][2]}: tensor {scale}: missing; the FP8 weight "
                             f"{module}.weight needs its {fmt.quant_method} {fmt.scheme} scale")
        dt, shape, fname = headers[scale]
        if tuple(shape) not in fmt.scale_shapes(n, k):
            raise ValueError(f"{fname}: tensor {scale}: expected shape "
                             f"{' or '.join(str(list(s)) for s in fmt.scale_shapes(n, k))} ({fmt.quant_method} "
                             f"{fmt.scheme} scale of a [{n}, {k}] weight), got {shape}")
        if fmt.scheme == "block" and k % 128:
            raise ValueError(f"{fname}: tensor {module}.weight: the block scheme needs in_features divisible by "
                             f"128, got {k}")
    return found


def load_fp8_dir(path: Path, config: Any, files: list[Path], fmt: "fp8_linear.CheckpointFormat",
                  dtype: torch.dtype, device: str | torch.device, attn_implementation: str) -> Any:
    """Build the model from ``config`` (random init, then overwritten), put the FP8 projections
    in as ``Fp8Linear`` and load every other tensor into its parameter."""
    from safetensors import safe_open
    with torch.device("meta"):
        skeleton = _build(config)
    fp8_modules = fp8_headers(files, fmt, skeleton)
    del skeleton
    device = torch.device(device)
    forked = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), torch.device(device):
        model = _build(config, dtype=dtype, attn_implementation=attn_implementation)
    expected = model.state_dict()
    weights, scales, biases, dense = {}, {}, {}, {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                module, _, leaf = name.rpartition(".")
                if module in fp8_modules:
                    if leaf == "weight":
                        weights[module] = handle.get_tensor(name)
                    elif leaf == fmt.scale_suffix:
                        scales[module] = handle.get_tensor(name)
                    elif leaf == "bias":
                        biases[module] = handle.get_tensor(name)
                    # activation_scale / input_scale: static activation scales, not used
                elif name in expected:
                    dense[name] = handle.get_tensor(name)
    for module, (n, k) in fp8_modules.items():
        scale = fp8_linear.convert_scale(fmt.scale_name(module), scales.pop(module), fmt, n, k).to(device)
        bias = biases.pop(module, None)
        layer = fp8_linear.Fp8Linear(
            weights.pop(module).to(device), scale, fmt.scheme,
            bias=None if bias is None else bias.to(device=device, dtype=dtype), name=f"{module}.weight",
        )
        model.set_submodule(module, layer)
    missing, _ = model.load_state_dict(dense, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [m for m in missing if m.rpartition(".")[0] not in fp8_modules and not (tied and m == "lm_head.weight")]
    if missing:  # check_weights saw every name; a key the model has under another name
        raise ValueError(f"model.safetensors: tensors {missing[:5]} of the model were not loaded from {path}")
    if tied:
        model.tie_weights()
    return model


def load_shard(path: Path, config: Any, files: list[Path], dtype: torch.dtype, device: str | torch.device,
                attn_implementation: str, tp: "parallel.TensorParallel") -> Any:
    """Rank ``tp.rank``'s shard of a float checkpoint: the model built on the meta device, cut
    to the shard (``parallel.shard_model``), given memory of the shard's sizes, and each tensor's
    slice read (``safe_open(...).get_slice``: only those bytes). ``model._fpv2_loaded_elements``
    counts the elements read."""
    from safetensors import safe_open
    device = torch.device(device)
    with torch.device("meta"):
        model = _build(config, dtype=dtype, attn_implementation=attn_implementation)
    shard = parallel.shard_model(model, tp)
    model.to_empty(device=device)
    _rebuild_rotary(model, device)
    params = dict(model.named_parameters())
    read, done = 0, set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                module = name.rpartition(".")[0]
                if module in shard.row_bias:
                    target = shard.row_bias[module] = handle.get_tensor(name).to(device=device, dtype=dtype)
                    read += target.numel()
                    done.add(name)
                    continue
                if name not in params:
                    continue
                sl = parallel.shard_slice(name, config, shard.layout, tp.rank)
                src = handle.get_slice(name)
                if sl is None:
                    t = src[:]
                else:
                    dim, start, length = sl
                    t = src[start:start + length] if dim == 0 else src[:, start:start + length]
                with torch.no_grad():
                    params[name].copy_(t)
                read += t.numel()
                done.add(name)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [n for n in params if n not in done and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"model.safetensors: tensors {missing[:5]} of the model were not loaded from {path}")
    if tied:
        model.tie_weights()
    model._fpv2_loaded_elements = read
    return model


def fp8_scale_slice(name: str, fmt: "fp8_linear.CheckpointFormat", shape: tuple[int, int],
                    sl: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    """``(dim, start, length)`` of a rank's slice of an FP8 weight's scale tensor, for the weight
    slice ``sl`` (``parallel.shard_slice``) of a ``[n, k]`` weight; ``None``: the whole scale.
    Per tensor: whole; per channel: the rows of a column-parallel shard, whole for a row-parallel
    one; 128x128 blocks: the tiles of the shard, whose boundaries must be multiples of 128 (a
    ValueError naming ``tensor_parallel_size`` otherwise)."""
    if sl is None or fmt.scheme == "tensor":
        return None
    dim, start, length = sl
    if fmt.scheme == "channel":
        return (0, start, length) if dim == 0 else None
    block = fp8_linear.fp8_gemm.BLOCK
    size = shape[dim]
    if start % block or (length % block and start + length != size):
        raise ValueError(f"tensor_parallel_size: the shard [{start}, {start + length}) of {name} (dim {dim} of "
                         f"{list(shape)}) does not start and end on 128 boundaries, which its 128x128 block scales "
                         "need; use a tensor_parallel_size that splits it into multiples of 128 (or TP 1)")
    return (dim, start // block, -(-length // block))


def load_fp8_shard(path: Path, config: Any, files: list[Path], fmt: "fp8_linear.CheckpointFormat",
                    dtype: torch.dtype, device: str | torch.device, attn_implementation: str,
                    tp: "parallel.TensorParallel") -> Any:
    """Rank ``tp.rank``'s shard of an FP8 checkpoint: as :func:`load_shard`, with each FP8
    projection read as its e4m3 weight slice and the matching slice of its scale
    (:func:`fp8_scale_slice`), put in as an ``Fp8Linear`` of the shard's shape. Every tensor is
    checked first (:func:`_fp8_headers`); no rank reads another rank's projections."""
    from safetensors import safe_open
    with torch.device("meta"):
        skeleton = _build(config)
    fp8_modules = fp8_headers(files, fmt, skeleton)
    del skeleton
    device = torch.device(device)
    with torch.device("meta"):
        model = _build(config, dtype=dtype, attn_implementation=attn_implementation)
    shard = parallel.shard_model(model, tp)
    plan = {}
    for module, (n, k) in fp8_modules.items():  # before any read: a bad block boundary fails first
        sl = parallel.shard_slice(f"{module}.weight", config, shard.layout, tp.rank)
        plan[module] = (sl, fp8_scale_slice(f"{module}.weight", fmt, (n, k), sl))
    model.to_empty(device=device)
    _rebuild_rotary(model, device)
    params = dict(model.named_parameters())

    def read_slice(handle: Any, name: str, sl: tuple[int, int, int] | None) -> torch.Tensor:
        if sl is None:
            return handle.get_tensor(name)
        src = handle.get_slice(name)
        dim, start, length = sl
        return src[start:start + length] if dim == 0 else src[:, start:start + length]

    read, done = 0, set()
    weights, scales, biases = {}, {}, {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                module, _, leaf = name.rpartition(".")
                if module in fp8_modules:
                    sl, scale_sl = plan[module]
                    if leaf == "weight":
                        t = weights[module] = read_slice(handle, name, sl)
                    elif leaf == fmt.scale_suffix:
                        t = scales[module] = read_slice(handle, name, scale_sl)
                    elif leaf == "bias":  # column parallel: the rows; row parallel: added once, after the reduction
                        row = sl is not None and sl[0] == 1
                        t = biases[module] = read_slice(handle, name, None if row or sl is None else sl)
                        if row:
                            shard.row_bias[module] = t.to(device=device, dtype=dtype)
                            del biases[module]
                    else:  # activation_scale / input_scale: static activation scales, not used
                        continue
                    read += t.numel()
                    done.add(name)
                    continue
                if module in shard.row_bias:
                    target = shard.row_bias[module] = handle.get_tensor(name).to(device=device, dtype=dtype)
                    read += target.numel()
                    done.add(name)
                    continue
                if name not in params:
                    continue
                t = read_slice(handle, name, parallel.shard_slice(name, config, shard.layout, tp.rank))
                with torch.no_grad():
                    params[name].copy_(t)
                read += t.numel()
                done.add(name)
    for module in fp8_modules:
        w = weights.pop(module)
        n, k = w.shape
        scale = fp8_linear.convert_scale(fmt.scale_name(module), scales.pop(module), fmt, n, k).to(device)
        bias = biases.pop(module, None)
        layer = fp8_linear.Fp8Linear(w.to(device), scale, fmt.scheme,
                                     bias=None if bias is None else bias.to(device=device, dtype=dtype),
                                     name=f"{module}.weight")
        model.set_submodule(module, layer)
    fp8_params = {f"{m}.{leaf}" for m in fp8_modules for leaf in ("weight", "bias")}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [n for n in dict(model.named_parameters()) if n not in done and n not in fp8_params
               and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"model.safetensors: tensors {missing[:5]} of the model were not loaded from {path}")
    if tied:
        model.tie_weights()
    parallel.install_reductions(model)  # the Fp8Linear modules replaced the hooked shards
    model._fpv2_loaded_elements = read
    return model
