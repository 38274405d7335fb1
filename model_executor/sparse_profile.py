"""Sparse-prefill profiles: a model's calibrated FlashPrefill V2 options, as a JSON file.

A profile is what ``python -m router calibrate`` writes for one model: the sparsest setting
of the grid (alpha, per-layer alpha, dense last tiles, energy rule, dense layers) that met a
quality budget against dense prefill, the ``dense_below`` length under which sparse prefill
does not pay, and the measurements behind both. ``serve`` loads the profile of the served
model (``sparse.profile``: ``"auto"`` picks the shipped one, :data:`SHIPPED`), and options
given explicitly override it.

The file is plain JSON (no pydantic: this layer runs where the serving extras are absent):

    {"format": "flashprefill-sparse-profile/1", "model": "builtin:smollm2-135m",
     "num_layers": 30, "sparse": {"alpha": 0.1, "last_dense_tiles": 2, ...},
     "dense_below": 4096, "expected_density": 0.4, "budget": {...}, "measured": [...],
     "provenance": {"command": "...", "date": "...", "device": "...", "versions": {...}}}
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernels.config import SparseConfig

PROFILE_FORMAT = "flashprefill-sparse-profile/1"
PROFILES_DIR = Path(__file__).with_name("profiles")
# the profiles shipped with the package, by model name (``model.model``)
SHIPPED = {"builtin:smollm2-135m": "smollm2-135m-instruct.json"}
# the SparseConfig fields a profile may set (num_splits and scale are the runtime's)
PROFILE_FIELDS = ("alpha", "block_size", "sink_tokens", "window_tokens", "mean_correction",
                  "last_dense_tiles", "energy_rule", "dense_layers", "layer_alpha")


@dataclass(frozen=True)
class SparseProfile:
    """One model's calibrated sparse options (see the module doc for the file)."""

    model: str
    num_layers: int
    sparse: Mapping[str, Any]
    dense_below: int | None = None
    expected_density: float | None = None
    budget: Mapping[str, Any] = field(default_factory=dict)
    measured: list = field(default_factory=list)
    provenance: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model: expected the calibrated model's name, got {self.model!r}")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"num_layers: expected an int >= 1, got {self.num_layers!r}")
        if not isinstance(self.sparse, Mapping):
            raise ValueError(f"sparse: expected a mapping of SparseConfig options, got {type(self.sparse).__name__}")
        unknown = sorted(set(self.sparse) - set(PROFILE_FIELDS))
        if unknown:
            raise ValueError(f"sparse: unknown options {unknown}; a profile sets {', '.join(PROFILE_FIELDS)}")
        config = self.sparse_config()  # the operator's own checks, naming the field
        if config.layer_alpha is not None and len(config.layer_alpha) > self.num_layers:
            raise ValueError(f"sparse.layer_alpha: expected at most num_layers = {self.num_layers} entries, "
                             f"got {len(config.layer_alpha)}")
        if self.dense_below is not None and (isinstance(self.dense_below, bool) or not isinstance(self.dense_below, int)
                                             or self.dense_below < 0):
            raise ValueError(f"dense_below: expected None or an int >= 0, got {self.dense_below!r}")
        d = self.expected_density
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0):
            raise ValueError(f"expected_density: expected None or a float in [0, 1], got {d!r}")

    def sparse_config(self, **overrides: Any) -> SparseConfig:
        """The profile's operator config (``overrides`` win)."""
        return SparseConfig(**{**dict(self.sparse), **overrides})

    def to_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, **dataclasses.asdict(self), "sparse": dict(self.sparse)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "SparseProfile":
        if not isinstance(raw, Mapping):
            raise ValueError(f"profile: expected a JSON object, got {type(raw).__name__}")
        if raw.get("format") != PROFILE_FORMAT:
            raise ValueError(f"format: expected {PROFILE_FORMAT!r}, got {raw.get('format')!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names - {"format"})
        if unknown:
            raise ValueError(f"profile: unknown keys {unknown}")
        missing = sorted({"model", "num_layers", "sparse"} - set(raw))
        if missing:
            raise ValueError(f"profile: missing keys {missing}")
        return cls(**{k: v for k, v in raw.items() if k != "format"})

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SparseProfile":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"sparse.profile: no such file {str(path)!r}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"sparse.profile: {str(path)!r} is not JSON ({exc})") from None
        try:
            return cls.from_dict(raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"sparse.profile: {str(path)!r}: {exc}") from None


def shipped_profile_path(model: str) -> Path | None:
    """The profile shipped for ``model`` (a ``model.model`` name), or None."""
    name = SHIPPED.get(model)
    return None if name is None else PROFILES_DIR / name


def resolve_profile(spec: str | None, model: str) -> SparseProfile | None:
    """``sparse.profile``: ``"auto"`` (the shipped profile of ``model``, None if it has none),
    ``"none"``/None (no profile) or a path to a profile file."""
    if spec is None or spec == "none":
        return None
    if not isinstance(spec, str) or not spec:
        raise ValueError(f'sparse.profile: expected "auto", "none" or a path, got {spec!r}')
    if spec == "auto":
        path = shipped_profile_path(model)
        return None if path is None or not path.exists() else SparseProfile.load(path)
    return SparseProfile.load(spec)
