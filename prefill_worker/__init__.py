"""prefill_worker package (see docs/ARCHITECTURE.md)."""
