"""The options checked against the model itself: its sparse profile, its context, its heads.

``serving.config``'s sections check each value alone; these read the model named by
``model.model`` (its shipped sparse profile, its config.json's context and head counts, never its
weights) and raise :class:`~serving.option_tree.ConfigError` / ``ValueError`` naming the option.
They take the config (or its nested dict) as it is, so that they need no import of
``serving.config``, which calls them while it builds a ``ServiceConfig``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from serving.option_tree import ConfigError

# what a sparse profile may set: its operator options, and dense_below / expected_density
_PROFILE_OPTIONS = ("alpha", "block_size", "sink_tokens", "window_tokens", "last_dense_tiles", "energy_rule",
                    "dense_layers", "layer_alpha", "mean_correction")


def with_sparse_profile(data: dict, *, default_model: str, default_profile: str | None) -> dict:
    """``data`` (nested sections) with the ``sparse.*`` options that it does not give taken from
    the sparse profile that ``sparse.profile`` names for ``model.model`` (``default_model`` and
    ``default_profile`` where ``data`` gives none). Options given win; a config built from
    :meth:`ServiceConfig.to_dict` gives them all, so this is idempotent."""
    from model_executor.sparse_profile import resolve_profile

    sparse = data.get("sparse")
    if isinstance(sparse, BaseModel):
        given = {k: getattr(sparse, k) for k in sparse.model_fields_set}
    elif isinstance(sparse, Mapping):
        given = dict(sparse)
    elif sparse is None:
        given = {}
    else:
        return data  # not a section: the section's own validation names it
    model = data.get("model")
    if isinstance(model, BaseModel):
        name = model.model
    elif isinstance(model, Mapping):
        name = model.get("model", default_model)
    else:
        name = default_model
    spec = given.get("profile", default_profile)
    if not isinstance(name, str) or not (spec is None or isinstance(spec, str)):
        return data  # the sections' own checks name the bad value
    try:
        profile = resolve_profile(spec, name)
    except ValueError as exc:
        raise ConfigError(str(exc) if str(exc).startswith("sparse.profile") else f"sparse.profile: {exc}") from None
    if profile is None:
        return data
    fill = {k: v for k, v in profile.sparse.items() if k in _PROFILE_OPTIONS}
    if profile.dense_below is not None:
        fill["dense_below"] = profile.dense_below
    if profile.expected_density is not None:
        fill["expected_density"] = float(profile.expected_density)
    if "layer_alpha" in fill and fill["layer_alpha"] is not None:
        fill["layer_alpha"] = list(fill["layer_alpha"])
    return {**data, "sparse": {**fill, **given}}


@functools.lru_cache(maxsize=32)
def _model_context(model: str, rope_scaling: str | None) -> Any:
    from model_executor.model_info import model_context

    return model_context(model, json.loads(rope_scaling) if rope_scaling else None)


def resolve_max_model_len(config: Any) -> int:
    """The context every request gets: ``model.max_model_len``, by default the model's own
    (``model_executor.loading.model_context``: its config alone, no weights). A value beyond the
    model's context without ``model.rope_scaling`` stretching it that far is a :class:`ConfigError`
    naming ``model.max_model_len``; the launcher, the application builder and the ingress ask."""
    m = config.model
    try:
        ctx = _model_context(m.model, json.dumps(m.rope_scaling, sort_keys=True) if m.rope_scaling else None)
    except ValueError as exc:  # the loader names rope_scaling or model
        raise ConfigError(f"model.{exc}") from None
    if ctx is None:  # a directory not on this machine: its replicas read it
        if m.max_model_len is None:
            raise ConfigError(f"model.max_model_len: the context of {m.model!r} cannot be read here (no config.json); "
                              "set model.max_model_len")
        return m.max_model_len
    if m.max_model_len is None:
        return ctx.tokens
    if m.max_model_len > ctx.tokens and ctx.trained:
        fix = ("raise model.rope_scaling's factor" if m.rope_scaling else
               'stretch its RoPE with model.rope_scaling (e.g. {"rope_type": "yarn", "factor": '
               f"{-(-m.max_model_len // ctx.tokens)}}})")
        raise ConfigError(f"model.max_model_len: {m.max_model_len} exceeds the context of {m.model} ({ctx.tokens} "
                          f"tokens: {ctx.source}); lower it, leave it unset, or {fix}")
    return m.max_model_len


def check_tensor_parallel(config: Any) -> None:
    """``prefill.tensor_parallel_size`` / ``decode.tensor_parallel_size`` against the model's head
    counts and MLP width, and ``runtime.devices_per_node``: ValueError naming the option. Without
    tensor parallelism it imports nothing (the ingress validates its config and never loads torch;
    with tensor parallelism the model's shape and the layout import it)."""
    limit = config.runtime.devices_per_node
    shape = None
    for side in ("prefill", "decode"):
        size = getattr(config, side).tensor_parallel_size
        if size == 1:
            continue
        name = f"{side}.tensor_parallel_size"
        if limit is not None and size > limit:
            raise ValueError(f"{name}: {size} ranks do not fit runtime.devices_per_node ({limit}): a replica's "
                             "ranks are packed on one node; lower it or use bigger nodes")
        from model_executor.loading import model_shape
        from model_executor.parallel import layout_of

        shape = shape or model_shape(config.model.model)
        if shape is not None:
            layout_of(shape, size, name=name)


__all__ = ["check_tensor_parallel", "resolve_max_model_len", "with_sparse_profile"]
