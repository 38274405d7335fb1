"""The channels as the registry knows them: ``nccl`` (CUDA pools) and ``gloo`` (CPU pools), the
same ends over either backend (the pool's device picks it), between TP groups too (every rank
its own channel). The ends' imports wait for the first build."""

from __future__ import annotations

from ..spec import BuildContext, RankContext, TransportSpec


def _args(context: BuildContext) -> dict:
    from .group import _end_args

    return _end_args({"host": context.host, "identity": dict(context.identity), "channel": context.section("channel")})


def _sender(context: BuildContext):
    from .send import ChannelSender

    return ChannelSender(context.device, **_args(context))


def _receiver(context: BuildContext):
    from .recv import ChannelReceiver

    peers = context.peers
    return ChannelReceiver(context.device, call_sender=peers.send_pages if peers is not None else None,
                           **_args(context))


def _group_sender(context: BuildContext):
    from .group import group_sender

    return group_sender(context)


def _group_receiver(context: BuildContext):
    from .group import group_receiver

    return group_receiver(context)


def _rank_end(role: str, context: RankContext):
    from .group import rank_end

    return rank_end(role, context)


_ENDS = dict(family="channel", in_groups=True, sender=_sender, receiver=_receiver, group_sender=_group_sender,
             group_receiver=_group_receiver, rank_end=_rank_end)
NCCL = TransportSpec(name="nccl", devices=("cuda",), summary="pairwise channels between CUDA pools", **_ENDS)
GLOO = TransportSpec(name="gloo", devices=("cpu",), summary="the same channels between CPU pools", **_ENDS)
