"""The object store as the registry knows it: any device, between TP groups too (merged and
split frames), and the ends' builders (imports of the ends wait for the first build)."""

from __future__ import annotations

from ..spec import BuildContext, RankContext, TransportSpec
from .config import ObjectStoreConfig


def _config(context: BuildContext) -> ObjectStoreConfig:
    return ObjectStoreConfig(**context.section("object_store"))


def _end(context: BuildContext):
    from .transport import ObjectStoreTransport

    return ObjectStoreTransport(fetch_timeout_s=_config(context).fetch_timeout_s)


def _group_sender(context: BuildContext):
    from .group import group_exporter

    return group_exporter(context.group, _config(context).fetch_timeout_s)


def _group_receiver(context: BuildContext):
    from .group import group_receiver

    return group_receiver(context.group, _config(context).fetch_timeout_s, fault_mode=context.fault_mode,
                          faults=context.rank_faults)


def _rank_end(role: str, context: RankContext):
    from .group import FrameRankEnd

    return FrameRankEnd(context)


OBJECT_STORE = TransportSpec(
    name="object_store", family="object_store", in_groups=True,
    summary="framed CPU bytes through Ray's object store (any devices, any nodes)",
    sender=_end, receiver=_end, group_sender=_group_sender, group_receiver=_group_receiver, rank_end=_rank_end,
)
