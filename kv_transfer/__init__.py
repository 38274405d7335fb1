"""kv_transfer package (see docs/ARCHITECTURE.md)."""
