"""Tensor parallelism (Megatron style) for the supported decoder models.

Which projection is cut how is each family's ``tp_split`` (``model_executor.models``); the dense
families (Llama, Qwen2, Qwen3) split as follows.

A model over a TP group of ``N`` ranks (a ``torch.distributed`` process group the caller made:
gloo on CPU, NCCL on GPUs; this module never creates one and never imports Ray):
- ``q_proj``/``k_proj``/``v_proj`` are column parallel: rank ``r`` keeps the output rows of its
  query and KV heads (``kv_cache.heads.HeadLayout``; KV heads replicated when ``N > Hkv``,
  as vLLM does). transformers' attention reshapes with ``-1`` heads, so the sharded module runs
  unchanged, and our attention (``model_executor.attention``) runs the sparse operator on the
  rank's own heads over the rank's own KV pool (``local_kv_heads`` heads). The block index is per
  KV head: attention adds no communication. With replicated KV heads (``N > Hkv``) each replica
  builds its index from its own query heads of the group: the selection of the TP=1 model whose
  KV heads are repeated ``N / Hkv`` times (dense attention and decode are exactly the model's).
- ``o_proj`` is row parallel (the input columns of the rank's query heads), followed by an
  all-reduce (a forward hook on the module, so the eager, fused and FP8 forwards, which all call
  ``self.o_proj``, reduce alike); a bias is added once, after the reduction.
- ``gate_proj``/``up_proj`` column parallel, ``down_proj`` row parallel + all-reduce.
- Embedding, norms and ``lm_head`` are **replicated**: every rank computes the full logits from
  the same (all-reduced) hidden states, so the sampler needs no gather and every rank's logits
  are the TP=1 ones up to the reduction's rounding. The cost is memory, ``2 x vocab x hidden``
  elements per rank (2.1 GB in bf16 at Llama-3.1-70B's shape, against 17.6 GB of sharded
  projections at TP=8: see :func:`shard_param_bytes`); a vocabulary-parallel LM head would save
  it for an all-gather per step.

FP8 weights: :meth:`Fp8Linear.narrow` cuts shards with their scales (quantize, then shard: the
scales are then the TP=1 ones). FP8 KV pools keep per-layer, per-KV-head descales, so a rank's
scales are the TP=1 scales of its heads. CUDA graphs capture the hooks' NCCL all-reduce (NCCL
supports capture); that path, like the fused Triton kernels, is rank-local code that only the GPU
runs can exercise.

Weights: :func:`shard_model` shards a model already built (the seeded built-in models, whose
random init must see the TP=1 RNG stream); ``loading.load_model_dir(..., tp=)`` reads only each
rank's slices from the safetensors files (:func:`shard_slice`), never the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kv_cache.heads import HeadLayout

from . import fp8_linear, models

TP_ATTR = "_fpv2_tp"  # on the model: its ModelShard


@dataclass(frozen=True)
class TensorParallel:
    """A rank of a TP group: ``rank`` of ``size``, ``group`` the ``torch.distributed`` process
    group (``None`` only for ``size == 1``)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size: expected an int >= 1, got {self.size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"rank: expected an int in [0, {self.size}), got {self.rank!r}")
        if self.size > 1 and self.group is None:
            raise ValueError("group: a TP group of more than one rank needs its torch.distributed process group")

    @classmethod
    def from_group(cls, group: Any) -> "TensorParallel":
        """This process's rank in ``group``: a ``torch.distributed`` ``ProcessGroup`` (the default
        group's ``dist.group.WORLD``, or one built on a store, ``ProcessGroupGloo(store, rank,
        size)``, as ``kv_transfer.channel`` does, which needs no default group)."""
        return cls(rank=int(group.rank()), size=int(group.size()), group=group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:  # the ProcessGroup's own call: works for groups outside the default one
            self.group.allreduce([x]).wait()
        return x


@dataclass
class ModelShard:
    """What :func:`shard_model` / the shard loader left on a model (``model._fpv2_tp``)."""

    tp: TensorParallel
    layout: HeadLayout
    row_bias: dict[str, torch.Tensor] = field(default_factory=dict)  # row-parallel module -> bias
    hooks: dict[str, Any] = field(default_factory=dict)


def _heads(config: Any) -> tuple[int, int, int]:
    hq = int(config.num_attention_heads)
    hkv = int(getattr(config, "num_key_value_heads", None) or hq)
    d = int(getattr(config, "head_dim", None) or config.hidden_size // hq)
    return hq, hkv, d


def layout_of(config: Any, tp_size: int, *, name: str = "tensor_parallel_size") -> HeadLayout:
    """The head layout of a model config over ``tp_size`` ranks; ValueError naming ``name`` when
    the heads (or the MLP width) do not split."""
    from kv_cache.heads import check_tp_size, divisors

    hq, hkv, _ = _heads(config)
    inter = int(config.intermediate_size)
    sizes = [n for n in divisors(hq, hkv) if inter % n == 0]
    check_tp_size(tp_size, hq, hkv, name=name, sizes=sizes)
    if inter % tp_size:
        raise ValueError(f"{name}: {tp_size} ranks must divide the model's MLP width {inter}; use one of {sizes}")
    return HeadLayout(hq, hkv, tp_size)


def shard_slice(name: str, config: Any, layout: HeadLayout, rank: int) -> tuple[int, int, int] | None:
    """``(dim, start, length)`` of rank ``rank``'s slice of the model tensor ``name``
    (``...q_proj.weight``, ``...down_proj.bias``, ...), ``None`` if every rank keeps it whole."""
    module, _, leaf = name.rpartition(".")
    if leaf not in ("weight", "bias") or layout.tp_size == 1:
        return None
    split = models.for_config(config).split_of(module.rpartition(".")[2])
    if split is None:
        return None
    _, _, d = _heads(config)
    if split.by == models.INTERMEDIATE:
        n = int(config.intermediate_size) // layout.tp_size
        start, length = rank * n, n
    else:
        heads = layout.q_heads(rank) if split.by == models.Q_HEADS else layout.kv_heads(rank)
        start, length = heads.start * d, len(heads) * d
    if split.parallel == models.ROW:
        return None if leaf == "bias" else (1, start, length)  # the bias is added after the reduction
    return (0, start, length)


def shard_of(model: torch.nn.Module) -> ModelShard | None:
    return getattr(model, TP_ATTR, None)


def _projections(model: torch.nn.Module) -> list[tuple[str, models.Split]]:
    """``(module name, split)`` of every projection the model's families split, in layer order;
    ValueError for a decoder layer of no registered family."""
    out = []
    for name, layer in models.decoder_layers(model):
        spec = models.for_layer(layer)
        if spec is None:
            raise ValueError(f"model: tensor parallelism needs decoder layers of a registered family "
                             f"({sorted(models.layer_classes('attention'))}); {name} of {type(model).__name__} "
                             f"has {type(layer.self_attn).__name__} and {type(layer.mlp).__name__}")
        prefix = f"{name}." if name else ""
        out += [(prefix + spec.projection_path(p), split) for p, split in spec.tp_split]
    return out


def shard_model(model: torch.nn.Module, tp: TensorParallel) -> ModelShard:
    """Cut ``model``'s projections (``torch.nn.Linear`` or ``Fp8Linear``) to rank ``tp.rank``'s
    shards in place, and install the row-parallel all-reduces. Works on meta models too (the
    shard loader's skeleton). ValueError if ``tp.size`` does not split the model."""
    if not isinstance(tp, TensorParallel):
        raise ValueError(f"tp: expected a TensorParallel, got {type(tp).__name__}")
    if shard_of(model) is not None:
        raise ValueError("model: already sharded")
    layout = layout_of(model.config, tp.size, name="tp")
    shard = ModelShard(tp=tp, layout=layout)
    for name, _ in _projections(model):
        mod = model.get_submodule(name)
        sl = shard_slice(name + ".weight", model.config, layout, tp.rank)
        if sl is None:
            continue
        dim, start, length = sl
        if isinstance(mod, fp8_linear.Fp8Linear):
            if dim == 1 and mod.bias is not None:
                shard.row_bias[name] = mod.bias
            model.set_submodule(name, mod.narrow(dim, start, length))
            continue
        weight = torch.nn.Parameter(mod.weight.detach().narrow(dim, start, length).contiguous(), requires_grad=False)
        bias = mod.bias
        if bias is not None:
            if dim == 0:
                mod.bias = torch.nn.Parameter(bias.detach().narrow(0, start, length).contiguous(), requires_grad=False)
            else:
                shard.row_bias[name] = bias.detach()
                mod.bias = None
        mod.weight = weight
        mod.out_features, mod.in_features = weight.shape
    setattr(model, TP_ATTR, shard)
    install_reductions(model)
    return shard


def _reduce_hook(shard: ModelShard, name: str):
    def hook(module, args, out):
        shard.tp.all_reduce(out)
        bias = shard.row_bias.get(name)
        return out if bias is None else out + bias

    return hook


def install_reductions(model: torch.nn.Module) -> int:
    """(Re)install the all-reduce after every row-parallel projection of a sharded model (a
    module replaced since, e.g. by ``fp8_linear.quantize_model``, gets its hook back); returns
    how many. A model without a shard: 0."""
    shard = shard_of(model)
    if shard is None or shard.tp.size == 1:
        return 0
    for handle in shard.hooks.values():
        handle.remove()
    shard.hooks.clear()
    for name, split in _projections(model):
        if split.parallel == models.ROW:
            shard.hooks[name] = model.get_submodule(name).register_forward_hook(_reduce_hook(shard, name))
    return len(shard.hooks)


def shard_param_bytes(config: Any, tp_size: int, *, bytes_per_param: float = 2.0) -> int:
    """Bytes of one rank's weights at ``tp_size`` (projections sharded, embedding, norms and
    ``lm_head`` replicated; FP8 projections: ``bytes_per_param`` 1 for those is not modelled)."""
    layout = layout_of(config, tp_size)
    hq, hkv, d = _heads(config)
    hidden, inter, vocab = int(config.hidden_size), int(config.intermediate_size), int(config.vocab_size)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    per_layer = (hidden * d * (layout.local_q_heads + 2 * layout.local_kv_heads)  # q, k, v
                 + layout.local_q_heads * d * hidden  # o
                 + 3 * hidden * inter // tp_size  # gate, up, down
                 + 2 * hidden)  # the two norms
    total = int(config.num_hidden_layers) * per_layer + vocab * hidden * (1 if tied else 2) + hidden
    return int(total * bytes_per_param)


# ---------------------------------------------------------------------------------------------
# lockstep: one replica's engine drives its TP ranks
# ---------------------------------------------------------------------------------------------
# The replica's process is rank 0 (the *leader*): its engine (one scheduler) decides every step
# and calls the runner and the pool as it does at TP=1. ``LockstepRunner`` / ``LockstepPool``
# replay every call that changes state (forwards, reservations, releases, prefix-cache entries)
# on the other ranks (*followers*, each a ``ModelRunner`` over its shard and its pool) through
# ``RankLink``s, so every rank's pool holds the same pages for the same requests (allocation is
# deterministic) and every forward runs on all ranks at once (the all-reduces need them all).
# A follower that dies or fails a step raises ``RankFailed`` in the leader: the replica is
# broken and must be replaced (its in-flight requests are retried as for any dead replica).

POOL_MUTATIONS = frozenset({"reserve", "adopt", "release", "reserve_with_prefix", "cache_prefix",
                            "clear_prefix_cache", "set_seq_len", "rename", "set_scales", "fork"})
RUNNER_STEPS = frozenset({"prefill", "prefill_keeping", "decode", "calibrate_kv_scales", "ensure_capacity"})


class RankFailed(RuntimeError):
    """A follower rank died or failed a step the leader did: the TP group is out of step."""


class RankLink:
    """How the leader reaches one follower: ``submit(command)`` starts it there and returns a
    handle at once (a forward must run on every rank concurrently); ``wait(handle)`` returns
    when it is done, raising ``RankFailed`` if the rank died or the step failed there.
    ``command`` is ``(target, method, args, kwargs)``, ``target`` ``"runner"`` or ``"pool"``."""

    def submit(self, command: tuple) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def wait(self, handle: Any) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def run_command(runner: Any, command: tuple) -> Any:
    """A follower executes one leader command on its own runner / pool (the result is dropped:
    only the leader's logits are sampled)."""
    target, method, args, kwargs = command
    allowed = RUNNER_STEPS if target == "runner" else POOL_MUTATIONS if target == "pool" else frozenset()
    if method not in allowed:
        raise ValueError(f"command: expected a runner step {sorted(RUNNER_STEPS)} or a pool mutation "
                         f"{sorted(POOL_MUTATIONS)}, got {target}.{method}")
    obj = runner if target == "runner" else runner.pool
    getattr(obj, method)(*args, **kwargs)
    return None


class _Group:
    def __init__(self, links: list[RankLink], on_failure: Any = None) -> None:
        self.links = links
        self.on_failure = on_failure  # called with the RankFailed before it is raised

    def run(self, command: tuple, local, *, concurrent: bool) -> Any:
        """``local()`` on the leader and ``command`` on every follower: concurrently (forwards)
        or leader first, followers only if the leader succeeded (bookkeeping the followers would
        refuse the same way)."""
        if not concurrent:
            out = local()
            self._wait([link.submit(command) for link in self.links])
            return out
        handles = [link.submit(command) for link in self.links]
        try:
            out = local()
        except BaseException as exc:
            try:
                self._wait(handles)  # the followers fail the same validation; drain them
            except RankFailed as dead:
                if not isinstance(exc, ValueError):  # a collective broken by a dead rank
                    raise dead from exc
            raise
        self._wait(handles)
        return out

    def _wait(self, handles: list) -> None:
        first = None
        for link, h in zip(self.links, handles):
            try:
                link.wait(h)
            except RankFailed as exc:
                first = first or exc
        if first is not None:
            if self.on_failure is not None:
                self.on_failure(first)
            raise first


class LockstepPool:
    """The leader's pool as the engine sees it: reads are local, mutations run on every rank."""

    def __init__(self, pool: Any, group: _Group) -> None:
        self._pool, self._group = pool, group

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._pool, name)
        if name not in POOL_MUTATIONS:
            return attr

        def mutate(*args, **kwargs):
            return self._group.run(("pool", name, args, kwargs), lambda: attr(*args, **kwargs), concurrent=False)

        return mutate


class LockstepRunner:
    """The leader's ``ModelRunner`` driving ``links`` (one per follower rank) in lockstep; what
    a TP replica's engine takes in place of the runner (same interface). ``on_failure(exc)``
    runs when a follower failed, before ``RankFailed`` is raised (a replica ends itself there)."""

    def __init__(self, runner: Any, links: list[RankLink], *, on_failure: Any = None) -> None:
        self._runner = runner
        self._group = _Group(list(links), on_failure)
        self.pool = LockstepPool(runner.pool, self._group)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    @property
    def leader(self) -> Any:
        """Rank 0's own ``ModelRunner``: what the transports read and write on this rank (the
        followers' sides go through their own calls)."""
        return self._runner

    def report_failure(self, exc: Exception) -> None:
        """A follower failed outside a lockstep call (a KV transfer's rank call): run
        ``on_failure`` as a failed step would, so the replica ends itself the same way."""
        if self._group.on_failure is not None:
            self._group.on_failure(exc)

    def keep_alive(self, *resources: Any) -> None:
        """Hold ``resources`` (the group's rendezvous store, its process group) as long as this."""
        self._kept = resources

    def _step(self, method: str, *args, concurrent: bool = True, **kwargs) -> Any:
        local = getattr(self._runner, method)
        return self._group.run(("runner", method, args, kwargs), lambda: local(*args, **kwargs), concurrent=concurrent)

    def prefill(self, items):
        return self._step("prefill", list(items))

    def prefill_keeping(self, items, keep_all=None, sparse_config=None):
        """Prompt logprobs and per-request sparsity (``PrefillEngine._forward``) run this one."""
        return self._step("prefill_keeping", list(items), None if keep_all is None else list(keep_all), sparse_config)

    def decode(self, request_ids, last_token_ids):
        return self._step("decode", list(request_ids), list(last_token_ids))

    def calibrate_kv_scales(self, *args, **kwargs) -> None:
        return self._step("calibrate_kv_scales", *args, **kwargs)

    def ensure_capacity(self, request_id: str, num_tokens: int) -> None:
        return self._step("ensure_capacity", request_id, num_tokens, concurrent=False)
