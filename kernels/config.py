"""Operator configuration: one frozen dataclass, validated on construction.

The semantics of every field are those of SPEC.md (shared with the reference and
every kernel): see ``docs/SEMANTICS.md`` for the project's copy and the places
where we refined it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ._scalars import check_int as _check_int
from ._scalars import softmax_scale as _softmax_scale

# Physical K/V tile (CSR granularity) and PackGQA query tile, fixed by the format.
KV_TILE = 64
Q_TILE = 128
# SparseConfig.energy_rule: the paper's released index ("first_key") and ours before it
ENERGY_RULES = ("first_key", "visible")
# the options one request may set for its own prefill (``SparseConfig.with_request``)
REQUEST_OPTIONS = ("alpha", "last_dense_tiles", "energy_rule", "dense_layers")


@dataclass(frozen=True)
class SparseConfig:
    """FlashPrefill V2 block-sparse attention options.

    alpha: energy threshold relative to the tile's strongest block, in [0, 1].
        ``alpha=0`` keeps every visible block (dense attention).
    block_size: logical key block ``Bs`` in tokens, a positive multiple of 64.
    sink_tokens: blocks starting before this key position are always kept.
    window_tokens: blocks overlapping the last ``window_tokens`` keys before each
        query tile (and the diagonal) are always kept.
    mean_correction: add the pruned fully-visible blocks' mean term (eq. 6).
    scale: softmax scale; ``None`` means ``1/sqrt(head_dim)``.
    num_splits: split-KV parts per query tile; 0 picks automatically, 1 disables.
    last_dense_tiles: the last ``N`` packed query tiles of each *prompt* attend densely (every
        causally visible block, no scoring, no correction): the rows that make the first
        generated token and the end of the prompt. Counted over the whole prompt
        (``prompt_lens`` of the plan), so a chunk that does not end its prompt has none and a
        prefix-cache hit changes nothing (docs/SEMANTICS.md "Dense last tiles").
    energy_rule: which rows score which block. ``"first_key"`` (the paper's released code): a
        row scores block ``J`` only if it sees the block's first key, and a block that the
        tile's last row does not see whole is not scored (it is kept through the window), so
        the diagonal never sets the threshold's maximum. ``"visible"``: every row of the tile
        scores every visible block (the semantics before the safeguards).
    dense_layers: the first ``N`` layers of a model attend densely (a model-level option: the
        operator ignores it; ``model_executor`` applies it per layer with :meth:`for_layer`).
    layer_alpha: per-layer thresholds (a model-level option, as ``dense_layers``): layer ``i``
        uses ``layer_alpha[i]``; layers past the tuple use ``alpha``. ``None``: ``alpha`` for all.
    """

    alpha: float = 0.1
    block_size: int = 128
    sink_tokens: int = 256
    window_tokens: int = 512
    mean_correction: bool = True
    scale: float | None = None
    num_splits: int = 0
    last_dense_tiles: int = 0
    energy_rule: str = "visible"
    dense_layers: int = 0
    layer_alpha: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise ValueError(f"alpha: expected a float in [0, 1], got {self.alpha!r}")
        if not (0.0 <= float(self.alpha) <= 1.0):
            raise ValueError(f"alpha: expected a value in [0, 1], got {self.alpha!r}")
        _check_int("block_size", self.block_size, minimum=KV_TILE)
        if self.block_size % KV_TILE:
            raise ValueError(
                f"block_size: expected a positive multiple of {KV_TILE}, got {self.block_size}"
            )
        _check_int("sink_tokens", self.sink_tokens, minimum=0)
        _check_int("window_tokens", self.window_tokens, minimum=0)
        if not isinstance(self.mean_correction, bool):
            raise ValueError(
                f"mean_correction: expected a bool, got {type(self.mean_correction).__name__}"
            )
        _softmax_scale(self.scale, 1)
        _check_int("num_splits", self.num_splits, minimum=0)
        _check_int("last_dense_tiles", self.last_dense_tiles, minimum=0)
        if self.energy_rule not in ENERGY_RULES:
            raise ValueError(f"energy_rule: expected one of {', '.join(map(repr, ENERGY_RULES))}, "
                             f"got {self.energy_rule!r}")
        _check_int("dense_layers", self.dense_layers, minimum=0)
        if self.layer_alpha is not None:
            if isinstance(self.layer_alpha, (str, bytes)) or not isinstance(self.layer_alpha, (tuple, list)):
                raise ValueError(f"layer_alpha: expected None or a sequence of floats in [0, 1], "
                                 f"got {self.layer_alpha!r}")
            for i, a in enumerate(self.layer_alpha):
                if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= float(a) <= 1.0:
                    raise ValueError(f"layer_alpha[{i}]: expected a float in [0, 1], got {a!r}")
            # a list would make the frozen config unhashable (plans are cached by config)
            object.__setattr__(self, "layer_alpha", tuple(float(a) for a in self.layer_alpha))

    @property
    def tiles_per_block(self) -> int:
        return self.block_size // KV_TILE

    def softmax_scale(self, head_dim: int) -> float:
        return _softmax_scale(self.scale, head_dim)

    def with_request(self, options: "dict | tuple | None", name: str = "sparse_attention") -> "SparseConfig":
        """This config with one request's own options (a mapping or ``(key, value)`` pairs of
        :data:`REQUEST_OPTIONS`); a request's ``alpha`` applies to every layer (it clears
        ``layer_alpha``). ValueError naming ``name.<option>``."""
        if not options:
            return self
        items = dict(options)
        unknown = sorted(set(items) - set(REQUEST_OPTIONS))
        if unknown:
            raise ValueError(f"{name}: unknown options {unknown}; a request may set {', '.join(REQUEST_OPTIONS)}")
        changes = dict(items)
        if "alpha" in changes:
            changes["layer_alpha"] = None
        try:
            return dataclasses.replace(self, **changes)
        except ValueError as exc:
            raise ValueError(f"{name}.{exc}") from None

    def alpha_of_layer(self, layer: int) -> float:
        """The threshold layer ``layer`` runs at: 0 (dense) below ``dense_layers``, else its
        ``layer_alpha`` entry, else ``alpha``."""
        if layer < self.dense_layers:
            return 0.0
        if self.layer_alpha is not None and layer < len(self.layer_alpha):
            return self.layer_alpha[layer]
        return float(self.alpha)

    def for_layer(self, layer: int) -> "SparseConfig":
        """The operator config of one model layer: ``alpha`` set to :meth:`alpha_of_layer`, the
        model-level fields cleared (so layers with the same threshold share one plan)."""
        alpha = self.alpha_of_layer(layer)
        if alpha == self.alpha and not self.dense_layers and self.layer_alpha is None:
            return self
        return dataclasses.replace(self, alpha=alpha, dense_layers=0, layer_alpha=None)

