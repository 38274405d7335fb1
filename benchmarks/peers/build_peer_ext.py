"""Run the peer's (qhfan/FlashPrefillv2) ``flashprefill_ops/setup.py build_ext`` on a machine
whose torch is the CPU wheel, for an H200 whose torch is a CUDA 13 build.

Called by ``stage_flashprefillv2.sh``; not part of the product. What it changes, and only in this
process (the peer's files are not edited):

- ``torch.utils.cpp_extension.CUDA_HOME`` is set from ``$CUDA_HOME`` (the CPU wheel leaves it None).
- ``CUDAExtension`` links ``c10_cuda`` and ``torch_cuda``, which the CPU wheel lacks: this points
  the linker at two stub libraries (``stubs/``) carrying those sonames, so the built ``.so`` keeps
  ``DT_NEEDED`` entries that the device's already-loaded torch libraries satisfy. The stub of
  ``libtorch_cuda.so`` defines the one CUDA shim the extension calls
  (``aoti_torch_get_current_cuda_stream``) so that ``--as-needed`` keeps the entry.
- ``--no-as-needed`` and ``-Wl,--strip-all`` at the link.

Usage: python build_peer_ext.py SRC_OPS_DIR BUILD_LIB BUILD_TEMP
(with the FLASH_ATTENTION_* environment set by the shell script).
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path


def make_stubs(stub_dir: Path) -> None:
    stub_dir.mkdir(parents=True, exist_ok=True)
    src = stub_dir / "torch_cuda_stub.c"
    src.write_text(
        "/* link-time stand-in; the device's real libtorch_cuda.so (same soname) is used at run time */\n"
        "#include <stdint.h>\n"
        "int32_t aoti_torch_get_current_cuda_stream(int32_t d, void** s) { (void)d; *s = 0; return 1; }\n")
    empty = stub_dir / "empty_stub.c"
    empty.write_text("/* link-time stand-in for libc10_cuda.so */\nint flashprefill_peer_c10_cuda_stub;\n")
    for lib, c in (("libtorch_cuda.so", src), ("libc10_cuda.so", empty)):
        subprocess.check_call(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{lib}", "-o",
                               str(stub_dir / lib), str(c)])


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        raise SystemExit("usage: build_peer_ext.py SRC_OPS_DIR BUILD_LIB BUILD_TEMP")
    ops_dir, build_lib, build_temp = (Path(a).resolve() for a in args)
    stub_dir = build_temp / "stubs"
    make_stubs(stub_dir)

    import torch.utils.cpp_extension as ce

    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    ce.CUDA_HOME = cuda_home
    orig = ce.CUDAExtension

    def cuda_extension(name, sources, *args, **kwargs):
        kwargs["library_dirs"] = list(kwargs.get("library_dirs", [])) + [str(stub_dir)]
        kwargs["extra_link_args"] = list(kwargs.get("extra_link_args", [])) + [
            "-Wl,--no-as-needed", "-Wl,--strip-all"]
        return orig(name, sources, *args, **kwargs)

    ce.CUDAExtension = cuda_extension
    os.chdir(ops_dir)
    sys.argv = ["setup.py", "build_ext", "--build-lib", str(build_lib), "--build-temp", str(build_temp)]
    sys.path.insert(0, str(ops_dir))
    runpy.run_path(str(ops_dir / "setup.py"), run_name="__main__")


if __name__ == "__main__":
    main()
