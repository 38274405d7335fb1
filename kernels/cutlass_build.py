"""Build, cache and load the CUTLASS/CuTe attention library (``kernels/csrc``) through a C ABI.

The library is plain CUDA C++ on the CuTe headers shipped by the ``nvidia-cutlass`` wheel
(the ``cutlass`` extra), compiled by ``nvcc`` for ``sm_90a`` into a shared object that links the
CUDA runtime statically and exports ``extern "C"`` functions only (``csrc/fp_attn_api.h``). It is
loaded with ``ctypes``: no torch C++ ABI, so a library built on a CPU machine (nvcc + headers,
no GPU) runs under any torch on the GPU host, and loading it needs no GPU driver.

Where the library comes from, in order:
1. ``FLASHPREFILL_CUTLASS_LIB``: an explicit prebuilt ``.so`` (e.g. carried to a GPU host that has
   neither nvcc nor the headers);
2. the build cache, ``$FLASHPREFILL_CACHE/cutlass/<key>/`` (default ``~/.cache/flashprefill``),
   keyed by a hash of the sources, the flags, the nvcc version and the CUTLASS version;
3. a build on first use (nvcc from ``$CUDA_HOME/bin`` or ``PATH``; headers from
   ``FLASHPREFILL_CUTLASS_INCLUDE`` or the installed ``nvidia-cutlass`` package).

``python -m kernels.cutlass_build --out DIR`` prebuilds into ``DIR`` and prints the per-kernel
ptxas usage: ``libfp_cutlass.so`` (CUDA runtime linked statically: needs glibc >= 2.34) and
``libfp_cutlass_cudart_shared.so`` (links ``libcudart.so.13``, which a CUDA torch has already
loaded; glibc >= 2.3), each with its ``.log`` (nvcc command, ptxas output) and ``.json``. The
loader falls back to the second when the first does not load on the GPU host.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIB_NAME = "libfp_cutlass.so"
LIB_NAME_SHARED_RT = "libfp_cutlass_cudart_shared.so"
ABI_VERSION = 8  # FP_ABI_VERSION in csrc/fp_attn_api.h
SRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("fp_attn_api.h", "sparse_attn_traits.cuh", "sparse_attn_ws.cuh", "sparse_attn_fwd.cu")
MAIN_SOURCE = "sparse_attn_fwd.cu"
ENV_LIB = "FLASHPREFILL_CUTLASS_LIB"
# FpKernel in csrc/fp_attn_api.h: warp-specialized with 128 / 64 keys per step; with 128 keys
# also in pingpong order, persistent with pingpong, and persistent alone
KERNELS = {"ws128": 0, "ws64": 1, "ws128_pingpong": 2, "ws128_persistent": 3,
           "ws128_persistent_nopingpong": 4}
DEFAULT_KERNEL = "ws128_persistent"  # fastest measured (BENCHMARKS.md, CUTLASS v1 persistent)
ENV_INCLUDE = "FLASHPREFILL_CUTLASS_INCLUDE"
ENV_CACHE = "FLASHPREFILL_CACHE"
NVCC_FLAGS = (
    "-gencode=arch=compute_90a,code=sm_90a",  # wgmma needs the arch-specific target
    "-O3",
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-lineinfo",  # source lines in compute-sanitizer reports; no effect on the code
    "-Xptxas", "-v",
    "-shared",
    "-Xcompiler", "-fPIC",
)
# static: no libcudart.so dependency, loads anywhere (no driver or toolkit) with glibc >= 2.34;
# shared: resolves libcudart.so.13 by soname (already in a CUDA torch process), old glibc
COMPILE_FLAGS = tuple(f for f in NVCC_FLAGS if f != "-shared")  # the device compile (-c)
LINK_FLAGS = ("-shared", "-gencode=arch=compute_90a,code=sm_90a")  # object + CUDA runtime -> library
CUDART_FLAGS = {"static": ("-cudart", "static"), "shared": ("-cudart", "shared")}
LIB_NAMES = {"static": LIB_NAME, "shared": LIB_NAME_SHARED_RT}
FP_OK, FP_ERR_ARGUMENT, FP_ERR_CUDA = 0, 1, 2
DTYPE_CODES = {"bfloat16": 0, "float16": 1, "float8_e4m3fn": 2}


class FpAttnParams(ctypes.Structure):
    """Mirror of ``FpAttnParams`` in ``csrc/fp_attn_api.h`` (checked against
    ``fp_params_size()`` on load)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "q", "k", "v", "kbar", "vbar", "out", "lse", "o_part", "lse_part",
        "seg_offsets", "kv_tiles", "order", "corr_bits", "cu_seqlens_q", "seqlens_kv",
        "cu_qtiles", "cu_blocks", "cu_blocks_v", "tile_seq", "page_table", "q_descale", "k_descale", "v_descale",
    )] + [(name, ctypes.c_int64) for name in (
        "sq_t", "sq_h", "sk_p", "sk_s", "sk_h", "sv_p", "sv_s", "sv_h", "sv_d",
        "skb_t", "skb_h", "svb_t", "svb_h", "svb_d", "s_pt",
        "sqd_b", "sqd_h", "skd_b", "skd_h", "svd_b", "svd_h",
    )] + [(name, ctypes.c_int32) for name in (
        "total_q", "total_tiles", "num_segments", "num_splits", "words_per_seg", "group_size",
        "num_qo_heads", "head_dim", "page_size", "num_pages", "total_blocks", "block_size", "dtype", "correction",
        "dense", "device",
    )] + [("qk_scale_log2", ctypes.c_float), ("kernel_variant", ctypes.c_int32),
          ("max_ctas", ctypes.c_int32)]


@dataclasses.dataclass(frozen=True)
class BuildResult:
    path: Path
    seconds: float  # compile time (0 for a cache hit)
    cached: bool
    log: str  # nvcc command and ptxas output


# ---------------------------------------------------------------------------------------------
# toolchain
# ---------------------------------------------------------------------------------------------


def find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def find_cutlass_include() -> Path | None:
    """The directory holding ``cute/`` and ``cutlass/``: ``FLASHPREFILL_CUTLASS_INCLUDE``, else
    the ``nvidia-cutlass`` wheel's ``cutlass_library/source/include`` (found without importing
    the package)."""
    override = os.environ.get(ENV_INCLUDE)
    candidates = [Path(override)] if override else []
    if not override:
        try:
            spec = importlib.util.find_spec("cutlass_library")
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin:
            candidates.append(Path(spec.origin).parent / "source" / "include")
    for path in candidates:
        if (path / "cute" / "tensor.hpp").exists() and (path / "cutlass" / "version.h").exists():
            return path
    return None


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def build_key(nvcc: str, include: Path, extra_flags: tuple[str, ...] = ()) -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode())
        h.update((SRC_DIR / name).read_bytes())
    h.update("\0".join(NVCC_FLAGS + extra_flags).encode())
    h.update(nvcc_version(nvcc).encode())
    h.update((include / "cutlass" / "version.h").read_bytes())
    return h.hexdigest()[:20]


def cache_root() -> Path:
    base = os.environ.get(ENV_CACHE)
    return (Path(base) if base else Path.home() / ".cache" / "flashprefill") / "cutlass"


def unavailable_reason() -> str | None:
    """Why the library can be neither loaded nor built here (None when it can)."""
    explicit = os.environ.get(ENV_LIB)
    if explicit:
        return None if Path(explicit).is_file() else f"{ENV_LIB}={explicit} is not a file"
    if find_nvcc() is None:
        return "nvcc not found (set CUDA_HOME or PATH, or point FLASHPREFILL_CUTLASS_LIB at a prebuilt library)"
    if find_cutlass_include() is None:
        return ("CUTLASS/CuTe headers not found (pip install 'flashprefill-serve[cutlass]' or set "
                f"{ENV_INCLUDE}, or point {ENV_LIB} at a prebuilt library)")
    return None


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------


def _compiled_object(nvcc: str, include: Path, obj_dir: Path, force: bool) -> tuple[Path, str]:
    """The kernels compiled once into a relocatable object (keyed like the library, without the
    runtime flag) and its compile log: both runtime flavours link the same object, so a build of
    both (``--out``, the tests) pays for one device compile, which is nearly all of the time."""
    key = build_key(nvcc, include)
    obj = obj_dir / f"fp_cutlass-{key}.o"
    log_path = obj.with_suffix(".log")
    if obj.is_file() and log_path.is_file() and not force:
        return obj, log_path.read_text()
    obj_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".compile-", suffix=".o", dir=obj_dir)
    os.close(fd)
    cmd = [nvcc, *COMPILE_FLAGS, f"-I{include}", f"-I{SRC_DIR}", "-c", str(SRC_DIR / MAIN_SOURCE), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = " ".join(cmd) + "\n" + proc.stdout + proc.stderr
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"nvcc failed ({proc.returncode}):\n{log[-6000:]}")
    os.replace(tmp, obj)  # atomic, as the library below
    log_path.write_text(log)
    return obj, log


def build(out_dir: str | Path | None = None, *, force: bool = False,
          cudart: str = "static") -> BuildResult:
    """Compile ``csrc/`` into ``out_dir`` (default: the cache directory of the build key);
    a present library with the same key is reused unless ``force``. ``cudart``: how the CUDA
    runtime is linked, ``static`` or ``shared``."""
    if cudart not in CUDART_FLAGS:
        raise ValueError(f"cudart: expected one of {tuple(CUDART_FLAGS)}, got {cudart!r}")
    nvcc, include = find_nvcc(), find_cutlass_include()
    if nvcc is None or include is None:
        raise RuntimeError(f"cannot build the CUTLASS attention library: {unavailable_reason()}")
    flags = NVCC_FLAGS + CUDART_FLAGS[cudart]
    key = build_key(nvcc, include, CUDART_FLAGS[cudart])
    target_dir = Path(out_dir) if out_dir is not None else cache_root() / key
    target = target_dir / LIB_NAMES[cudart]
    log_path, meta_path = target.with_suffix(".log"), target.with_suffix(".json")
    if target.is_file() and not force and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("key") == key:
            log = log_path.read_text() if log_path.is_file() else ""
            return BuildResult(target, 0.0, True, log)
    target_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    obj, compile_log = _compiled_object(nvcc, include, target_dir if out_dir is not None else cache_root() / "objects", force)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target_dir)
    os.close(fd)
    cmd = [nvcc, *LINK_FLAGS, *CUDART_FLAGS[cudart], str(obj), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    log = compile_log + " ".join(cmd) + "\n" + proc.stdout + proc.stderr
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"nvcc failed ({proc.returncode}):\n{log[-6000:]}")
    os.replace(tmp, target)  # atomic: concurrent builders never see a partial library
    log_path.write_text(log)
    meta = {"key": key, "seconds": round(seconds, 1), "nvcc": nvcc_version(nvcc).splitlines()[-1],
            "include": str(include), "flags": list(flags), "kernels": ptxas_usage(log)}
    meta_path.write_text(json.dumps(meta, indent=1))
    return BuildResult(target, seconds, False, log)


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def _demangle(name: str) -> str:
    # _ZN2fp25sparse_attn_fwd_ws_kernelINS_8WsTraitsIN7cutlass10bfloat16_tELi128ELi128ELi3EEEEEv...
    # (head_dim, keys per step, stages[, pingpong, persistent]) -> "ws128<bf16,d128>",
    # "ws128_pingpong<...>", "ws128_persistent<...>"; combine kernels -> "combine<bf16,d128>"
    dtype = ("bf16" if "bfloat16" in name else "fp16" if "half_t" in name
             else "e4m3" if "float_e4m3" in name else "?")
    ints = re.findall(r"ELi(\d+)", name)
    dim = ints[0] if ints else "?"
    if "sparse_attn_fwd_ws_kernel" in name:
        kind = f"ws{ints[1]}" if len(ints) > 1 else "ws?"
        flags = re.findall(r"ELb([01])", name)  # kPingpong, kPersistent
        if flags[1:2] == ["1"]:
            kind += "_persistent" if flags[:1] == ["1"] else "_persistent_nopingpong"
        elif flags[:1] == ["1"]:
            kind += "_pingpong"
    else:
        kind = "combine" if "combine" in name else name
    return f"{kind}<{dtype},d{dim}>"


def ptxas_usage(log: str) -> list[dict]:
    """Per kernel: registers, stack and spill bytes, from the ``-Xptxas -v`` output."""
    rows: list[dict] = []
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            rows.append({"kernel": _demangle(m.group(1)), "arch": m.group(2)})
            continue
        if not rows:
            continue
        m = _STACK.search(line)
        if m:
            rows[-1].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                            spill_loads=int(m.group(3)))
        m = _REGS.search(line)
        if m:
            rows[-1]["registers"] = int(m.group(1))
    return rows


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------


def library_path() -> Path:
    """The library to load: the explicit prebuilt one, else the cached (or a fresh) build."""
    explicit = os.environ.get(ENV_LIB)
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise RuntimeError(f"{ENV_LIB}={explicit} is not a file")
        return path
    return build().path


def _open(path: str) -> ctypes.CDLL:
    """CDLL of ``path``; when it does not load (e.g. the static-runtime build on a host whose
    glibc is older than 2.34), the shared-runtime build next to it."""
    try:
        return ctypes.CDLL(path)
    except OSError as first:
        sibling = Path(path).with_name(LIB_NAME_SHARED_RT)
        if Path(path).name == LIB_NAME_SHARED_RT or not sibling.is_file():
            raise
        try:
            return ctypes.CDLL(str(sibling))
        except OSError as second:
            raise OSError(f"{path}: {first}; {sibling}: {second}") from second


@functools.lru_cache(maxsize=None)
def _load(path: str) -> ctypes.CDLL:
    lib = _open(path)
    lib.fp_abi_version.restype = ctypes.c_int
    lib.fp_abi_version.argtypes = []
    lib.fp_params_size.restype = ctypes.c_size_t
    lib.fp_params_size.argtypes = []
    lib.fp_sparse_attn_fwd.restype = ctypes.c_int
    lib.fp_sparse_attn_fwd.argtypes = [ctypes.POINTER(FpAttnParams), ctypes.c_void_p]
    lib.fp_kernel_attributes.restype = ctypes.c_int
    lib.fp_kernel_attributes.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.fp_last_error.restype = ctypes.c_char_p
    lib.fp_last_error.argtypes = []
    version = lib.fp_abi_version()
    if version != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI version {version}, this package expects {ABI_VERSION}: rebuild it")
    size = lib.fp_params_size()
    if size != ctypes.sizeof(FpAttnParams):
        raise RuntimeError(f"{path}: FpAttnParams is {size} bytes, the Python mirror "
                           f"{ctypes.sizeof(FpAttnParams)}: rebuild it")
    return lib


def load_library() -> ctypes.CDLL:
    """The loaded library (built first when needed); RuntimeError when that is impossible.
    Resolved once per process and ``FLASHPREFILL_CUTLASS_LIB`` value (no hashing per call)."""
    return _load_for(os.environ.get(ENV_LIB))


@functools.lru_cache(maxsize=None)
def _load_for(explicit: str | None) -> ctypes.CDLL:
    return _load(str(library_path().resolve()))


def check_status(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status != FP_OK:
        msg = lib.fp_last_error().decode(errors="replace")
        raise RuntimeError(f"{what} failed (status {status}): {msg}")


def kernel_attributes(dtype: str, head_dim: int, variant: str = DEFAULT_KERNEL) -> dict:
    """Registers, local (spill) bytes, shared bytes of the attention kernel (needs a GPU)."""
    if variant not in KERNELS:
        raise ValueError(f"variant: expected one of {tuple(KERNELS)}, got {variant!r}")
    lib = load_library()
    out = (ctypes.c_int * 4)()
    check_status(lib, lib.fp_kernel_attributes(KERNELS[variant], DTYPE_CODES[dtype], head_dim, out),
                 "fp_kernel_attributes")
    return {"registers": out[0], "local_bytes": out[1], "shared_bytes": out[2],
            "max_threads": out[3]}


# ---------------------------------------------------------------------------------------------
# host-side layout check (csrc/layout_check.cu: the kernel's index mappings, on a CPU)
# ---------------------------------------------------------------------------------------------


def nvcc_host_includes(nvcc: str) -> list[str]:
    """The include flags nvcc passes its host compiler (the toolkit's headers, and CCCL's
    ``cuda/std`` on CUDA 13), as ``nvcc --dryrun`` prints them; [] where it prints none."""
    proc = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True)
    flags: list[str] = []
    for line in (proc.stdout + proc.stderr).splitlines():
        for var in ("INCLUDES", "SYSTEM_INCLUDES"):
            if line.startswith(f"#$ {var}="):
                flags += shlex.split(line.split("=", 1)[1])
    return flags


def layout_check_command(nvcc: str, include: Path, exe: Path) -> list[str]:
    """The compile command of csrc/layout_check.cu. It holds host code only, so it goes straight
    to the host C++ compiler (``g++``) with the include flags nvcc would give it: nvcc adds a
    device pass (cudafe++ and cicc over every CuTe header) that compiles nothing here and took
    about half of the check's minute on 2 cores. Neither pass defines ``__CUDA_ARCH__``, so the
    host code, and the check's output, are the same. nvcc itself where there is no ``g++`` or
    its dry run names no includes."""
    source = [f"-I{include}", f"-I{SRC_DIR}", str(SRC_DIR / "layout_check.cu"), "-o", str(exe)]
    cxx = shutil.which("g++") or shutil.which("c++")
    toolkit = nvcc_host_includes(nvcc) if cxx else []
    if not toolkit:
        return [nvcc, "-std=c++17", "--expt-relaxed-constexpr", *source]
    return [cxx, "-std=c++17", "-x", "c++", *toolkit, *source]


def run_layout_check(work_dir: str | Path) -> subprocess.CompletedProcess:
    nvcc, include = find_nvcc(), find_cutlass_include()
    if nvcc is None or include is None:
        raise RuntimeError(f"cannot build the layout check: {unavailable_reason()}")
    exe = Path(work_dir) / "layout_check"
    subprocess.run(layout_check_command(nvcc, include, exe), check=True, capture_output=True, text=True)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=str, default=None,
                    help="build into this folder (default: the cache); carry it to the GPU host "
                         f"and set {ENV_LIB}=DIR/{LIB_NAME}")
    ap.add_argument("--force", action="store_true", help="rebuild even when the key matches")
    ap.add_argument("--cudart", choices=("static", "shared", "both"), default=None,
                    help="CUDA runtime linking (default: both with --out, static otherwise)")
    ap.add_argument("--check-layouts", action="store_true",
                    help="also compile and run csrc/layout_check.cu (host-side index checks)")
    args = ap.parse_args(argv)
    cudart = args.cudart or ("both" if args.out else "static")
    flavours = ("static", "shared") if cudart == "both" else (cudart,)
    results = [build(args.out, force=args.force, cudart=f) for f in flavours]
    for result in results:
        print(f"library  {result.path}")
        print(f"seconds  {result.seconds:.1f}" + ("  (cache hit)" if result.cached else ""))
    for row in ptxas_usage(results[0].log):
        print(f"kernel   {row['kernel']:<22} registers {row.get('registers', '?'):>3}  "
              f"stack {row.get('stack', '?')}  spill stores {row.get('spill_stores', '?')}  "
              f"spill loads {row.get('spill_loads', '?')}")
    result = results[0]
    if args.check_layouts:
        with tempfile.TemporaryDirectory() as tmp:
            proc = run_layout_check(tmp)
        print(proc.stdout.strip())
        if proc.returncode != 0:
            return 1
    print(f"use      export {ENV_LIB}={result.path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
