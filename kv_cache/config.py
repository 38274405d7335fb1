"""``KVPoolConfig``: the shape, dtype, device and capacity of a KV pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._scalars import check_int

POOL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


@dataclass(frozen=True)
class KVPoolConfig:
    """Shape, dtype and capacity of a pool. Give exactly one of ``num_pages`` and
    ``memory_budget_bytes`` (capacity ``memory_budget_bytes // page_bytes``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 64
    dtype: torch.dtype = torch.bfloat16
    device: str | torch.device = "cpu"
    num_pages: int | None = None
    memory_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, minimum=1)
        check_int("num_kv_heads", self.num_kv_heads, minimum=1)
        check_int("head_dim", self.head_dim, minimum=1)
        check_int("page_size", self.page_size, minimum=1)
        if self.dtype not in POOL_DTYPES:
            want = ", ".join(str(d).replace("torch.", "") for d in POOL_DTYPES)
            raise ValueError(f"dtype: expected one of ({want}), got {self.dtype!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: expected a torch device or its name, got {self.device!r}") from exc
        if (self.num_pages is None) == (self.memory_budget_bytes is None):
            raise ValueError(
                "num_pages: expected exactly one of num_pages and memory_budget_bytes, got "
                f"num_pages={self.num_pages!r}, memory_budget_bytes={self.memory_budget_bytes!r}"
            )
        if self.num_pages is not None:
            check_int("num_pages", self.num_pages, minimum=1)
        else:
            check_int("memory_budget_bytes", self.memory_budget_bytes, minimum=1)
            if self.memory_budget_bytes < self.page_bytes:
                raise ValueError(
                    f"memory_budget_bytes: expected at least one page ({self.page_bytes} bytes "
                    f"for K+V over {self.num_layers} layers), got {self.memory_budget_bytes}"
                )

    @property
    def page_bytes(self) -> int:
        """K+V bytes of one page over all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * elem

    @property
    def v_token_major(self) -> bool:
        """V stored token-major (FP8 pools: the K-major operand of fp8 wgmma)."""
        return self.dtype == torch.float8_e4m3fn

    @property
    def capacity(self) -> int:
        """Number of pages the pool holds."""
        if self.num_pages is not None:
            return self.num_pages
        return self.memory_budget_bytes // self.page_bytes
