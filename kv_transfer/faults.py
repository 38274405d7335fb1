"""Fault injection into frames (tests and drills: ``fault_injection`` in the service's options)."""

from __future__ import annotations

import numpy as np

FRAME_FAULTS = ("flip", "truncate")


def maybe_corrupt(frame: np.ndarray, fault: str | None) -> np.ndarray:
    """``frame`` itself, or damaged as ``fault`` says (None: intact)."""
    return frame if fault is None else corrupt_frame(frame, fault)


def corrupt_frame(frame: np.ndarray, mode: str) -> np.ndarray:
    """Fault injection for tests and drills: ``"flip"`` one payload byte, ``"truncate"`` the tail."""
    if mode == "flip":
        bad = frame.copy()
        bad[-1] ^= 0xFF
        return bad
    if mode == "truncate":
        return frame[: max(len(frame) - 7, 0)].copy()
    raise ValueError(f"mode: expected 'flip' or 'truncate', got {mode!r}")
