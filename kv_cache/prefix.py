"""Prefix digests: the key of a full page of prompt tokens in the prefix cache, also what the
prefill router uses to send a prompt where its prefix is cached.

Page ``i``'s digest is BLAKE2b-128 over page ``i - 1``'s digest and the page's token ids (int64,
little-endian): it stands for the whole prefix ``[0, (i + 1) * page_size)``, so two prompts share
a digest only if they share every token up to there. No torch: the ingress computes these too.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16


def prefix_digests(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Digest of each *full* page of ``token_ids`` (a partial last page has none)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected an int >= 1, got {page_size!r}")
    try:
        ids = array("q", token_ids)  # a list of ints: one C loop
    except TypeError:  # numpy or torch scalars
        ids = array("q", (int(t) for t in token_ids))
    if sys.byteorder != "little":
        ids.byteswap()
    raw = ids.tobytes()
    step = page_size * ids.itemsize
    digests, parent = [], b""
    for i in range(len(ids) // page_size):
        parent = hashlib.blake2b(parent + raw[i * step:(i + 1) * step], digest_size=DIGEST_BYTES).digest()
        digests.append(parent)
    return digests
