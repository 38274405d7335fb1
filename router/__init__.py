"""router package (see docs/ARCHITECTURE.md)."""
