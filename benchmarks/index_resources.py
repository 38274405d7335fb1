"""The index stage's kernels as compiled for the H100/H200 (sm_90), on a CPU box: registers,
stack, shared memory, and how many programs of each fit one SM beside the launch's intent.

Why: ``kernels.triton_index`` launches ``IndexLaunch.programs_per_sm`` persistent score programs
per SM and relies on all of them being resident at once (one program's exp2 hides another's
wgmma). If a kernel change raises the register count past what that many programs can hold, the
extra programs run as a second wave after the first ones finish, and nothing fails: the index only
gets slower (issue #38, ``benchmarks/peers/FLASHPREFILLV2.md``). This script shows that without a
GPU.

How: the real host wrappers (``block_means``, ``select_and_compact``) run on small CPU tensors with
the strides of the serving layout (32/8 heads, d=128, page 64 unless told), while Triton's driver
is replaced by one that reports an sm_90 target and every launch only compiles; ``cuobjdump``
(shipped with Triton) reads the resources from each cubin. Run without ``TRITON_INTERPRET`` (the
interpreter's patches break real compiles)::

    .venv/bin/python benchmarks/index_resources.py            # bf16 and e4m3, the default launch
    .venv/bin/python benchmarks/index_resources.py --score-maxnreg 168 --out /tmp/r.json

Prints a table and writes ``benchmarks/results/index_resources_sm90.json``. ``fit/SM`` is the
number of programs of one kernel that the register file, shared memory and warp slots of one SM
hold at once (``programs_per_sm_fit``); ``launch/SM`` is what the launch asks for (the score
kernel's ``programs_per_sm``; the other two are plain grids).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# sm_90 (H100 / H200) per-SM limits: CUDA C Programming Guide, "Compute capabilities" table
SM90_REGS_PER_SM = 65536
SM90_REG_ALLOC_UNIT = 256  # registers are given to a warp in units of 256
SM90_MAX_WARPS_PER_SM = 64
SM90_MAX_PROGRAMS_PER_SM = 32
SM90_SMEM_PER_SM = 233472  # 228 KiB
SM90_SMEM_RESERVED_PER_PROGRAM = 1024


def programs_per_sm_fit(regs_per_thread: int, num_warps: int, shared_bytes: int) -> int:
    """How many programs (CTAs) of ``num_warps`` warps, ``regs_per_thread`` registers and
    ``shared_bytes`` of dynamic shared memory one sm_90 SM holds at once."""
    for name, val in (("regs_per_thread", regs_per_thread), ("num_warps", num_warps)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
    if isinstance(shared_bytes, bool) or not isinstance(shared_bytes, int) or shared_bytes < 0:
        raise ValueError(f"shared_bytes: expected an int >= 0, got {shared_bytes!r}")
    per_warp = -(-regs_per_thread * 32 // SM90_REG_ALLOC_UNIT) * SM90_REG_ALLOC_UNIT
    by_regs = SM90_REGS_PER_SM // (per_warp * num_warps)
    by_warps = SM90_MAX_WARPS_PER_SM // num_warps
    by_smem = SM90_SMEM_PER_SM // (shared_bytes + SM90_SMEM_RESERVED_PER_PROGRAM)
    return min(by_regs, by_warps, by_smem, SM90_MAX_PROGRAMS_PER_SM)


@dataclasses.dataclass(frozen=True)
class KernelResources:
    kernel: str
    dtype: str
    regs: int
    stack_bytes: int
    local_bytes: int
    shared_bytes: int
    num_warps: int
    num_stages: int
    fit_per_sm: int
    launch_per_sm: int | None  # persistent grids only


_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)")


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def cubin_resources(cubin: bytes) -> tuple[int, int, int]:
    """``(registers, stack bytes, local bytes)`` of the one kernel in ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    m = _RES.search(out)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource line: {out[:300]!r}")
    return int(m[1]), int(m[2]), int(m[3])


class _Sm90CompileOnly:
    """Triton's active driver for this process: an sm_90 target, and no device behind it."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def compile_index(dtype: str, *, seqlen: int = 1024, page_size: int = 64, score_maxnreg: int | None = None,
                  programs_per_sm: int | None = None, tree: Path | None = None) -> list[KernelResources]:
    """Compile the three index kernels as the host wrappers would launch them for ``dtype``
    (``bfloat16`` or ``fp8_e4m3``) at 32/8 heads, d=128; nothing is launched. ``tree``: a folder
    holding another version's ``kernels/`` package (``git archive COMMIT kernels | tar -x -C
    DIR``), compiled instead of this checkout's (once per process: the package is imported)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("TRITON_INTERPRET: must be unset (the interpreter's patches break real compiles)")
    if dtype not in ("bfloat16", "fp8_e4m3"):
        raise ValueError(f"dtype: expected 'bfloat16' or 'fp8_e4m3', got {dtype!r}")
    import torch
    from triton.runtime import driver, jit

    src = str(ROOT if tree is None else Path(tree).resolve())
    if not (Path(src) / "kernels" / "triton_index.py").is_file():
        raise ValueError(f"tree: expected a folder holding kernels/triton_index.py, got {src!r}")
    if src in sys.path:
        sys.path.remove(src)
    sys.path.insert(0, src)
    from kernels import triton_index

    if Path(triton_index.__file__).resolve().parents[1] != Path(src):
        raise ValueError(f"tree: kernels was already imported from {triton_index.__file__}, not {src}")
    from kernels.config import SparseConfig
    from kernels.ops import plan_prefill
    from kernels.paged import contiguous_to_paged

    launch = triton_index.IndexLaunch()
    if score_maxnreg is not None:
        launch = dataclasses.replace(launch, score_maxnreg=score_maxnreg)
    if programs_per_sm is not None:
        launch = dataclasses.replace(launch, programs_per_sm=programs_per_sm)
    hq, hkv, d = 32, 8, 128
    tdt = torch.float8_e4m3fn if dtype == "fp8_e4m3" else torch.bfloat16
    q = torch.zeros(seqlen, hq, d, dtype=tdt)
    kp, table = contiguous_to_paged(torch.zeros(1, seqlen, hkv, d, dtype=tdt), page_size)
    vp = kp.clone()
    i32 = dict(dtype=torch.int32)
    plan = plan_prefill(q, kp, vp, table, torch.tensor([0, seqlen], **i32), torch.tensor([seqlen], **i32),
                        SparseConfig())
    fp8 = {}
    if dtype == "fp8_e4m3":
        from kernels.fp8 import Fp8Descales

        one = torch.ones(1, 1, dtype=torch.float32)
        fp8 = {"descales": Fp8Descales(q=one, k=one, v=one)}

    built: list[tuple[str, object]] = []
    run = jit.JITFunction.run
    previous = driver._active  # None on a machine without a GPU (no default driver to build)

    def compile_only(self, *args, grid, warmup, **kw):
        kernel = run(self, *args, grid=grid, warmup=True, **kw)
        built.append((self.fn.__name__, kernel))
        return kernel

    jit.JITFunction.run = compile_only
    driver.set_active(_Sm90CompileOnly())
    try:
        means, kbar_q = triton_index.block_means(kp, vp, plan, q.dtype, launch=launch, **fp8)
        # capacity given: no read-back of the (never computed) counts
        triton_index.select_and_compact(q, plan, means, kbar_q, capacity=plan.num_segments, launch=launch, **fp8)
    finally:
        jit.JITFunction.run = run
        driver._active = previous

    out = []
    for name, kernel in built:
        regs, stack, local = cubin_resources(kernel.asm["cubin"])
        md = kernel.metadata
        out.append(KernelResources(
            kernel=name, dtype=dtype, regs=regs, stack_bytes=stack, local_bytes=local, shared_bytes=md.shared,
            num_warps=md.num_warps, num_stages=md.num_stages,
            fit_per_sm=programs_per_sm_fit(regs, md.num_warps, md.shared),
            launch_per_sm=launch.programs_per_sm if name == "_score_select_kernel" else None))
    return out


def launched_resources(jit_fn) -> list[dict]:
    """Registers, spills and shared memory of every variant of ``jit_fn`` this process has
    launched on a GPU (what the driver loaded, for comparison with the CPU compile), with the
    programs per SM they allow. Empty under the interpreter or before a launch."""
    out = []
    for cache in getattr(jit_fn, "device_caches", {}).values():
        for kernel in cache[0].values():
            if hasattr(kernel, "result"):  # an asynchronous compile's future
                kernel = kernel.result()
            regs = getattr(kernel, "n_regs", None)
            if regs is None:  # compiled, never loaded
                continue
            md = kernel.metadata
            out.append({"kernel": jit_fn.fn.__name__, "regs": int(regs), "spills": int(kernel.n_spills),
                        "shared_bytes": int(md.shared), "num_warps": int(md.num_warps),
                        "fit_per_sm": programs_per_sm_fit(int(regs), int(md.num_warps), int(md.shared))})
    return out


def table(rows: list[KernelResources]) -> str:
    head = f"{'kernel':<22} {'dtype':<9} {'regs':>5} {'stack':>6} {'smem B':>7} {'warps':>5} {'fit/SM':>6} {'launch/SM':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        launch = "-" if r.launch_per_sm is None else str(r.launch_per_sm)
        flag = "  <- second wave" if r.launch_per_sm is not None and r.fit_per_sm < r.launch_per_sm else ""
        lines.append(f"{r.kernel:<22} {r.dtype:<9} {r.regs:>5} {r.stack_bytes:>6} {r.shared_bytes:>7} "
                     f"{r.num_warps:>5} {r.fit_per_sm:>6} {launch:>9}{flag}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,fp8_e4m3")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--score-maxnreg", type=int, default=None, help="IndexLaunch.score_maxnreg (default: none)")
    ap.add_argument("--programs-per-sm", type=int, default=None, help="IndexLaunch.programs_per_sm (default 3)")
    ap.add_argument("--tree", type=Path, default=None,
                    help="folder holding another version's kernels/ (git archive COMMIT kernels | tar -x -C DIR)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "index_resources_sm90.json")
    args = ap.parse_args(argv)
    if args.page_size < 1:
        ap.error(f"--page-size: expected >= 1, got {args.page_size}")
    rows = []
    for dt in (x for x in args.dtypes.split(",") if x):
        rows.extend(compile_index(dt, page_size=args.page_size, score_maxnreg=args.score_maxnreg,
                                  programs_per_sm=args.programs_per_sm, tree=args.tree))
    import triton

    sys.path.append(str(ROOT))
    from evals.report import git_commit

    report = {"benchmark": "index kernels' sm_90 resources (compiled on CPU, not run)", "target": "sm_90",
              "triton": triton.__version__, "commit": git_commit(),
              "kernels_from": "this checkout" if args.tree is None else str(args.tree),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "rows": [dataclasses.asdict(r) for r in rows]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(rows))
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
