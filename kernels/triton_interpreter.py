"""Fixes for Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``), applied by every
``kernels.triton_*`` module at import when the interpreter is active.

The bugs are the interpreter's, not the kernels' (compiled Triton on a GPU has none of them),
and they made a user's script under ``TRITON_INTERPRET=1`` crash or compute wrongly where the
test suite did not:
- a tensor loop bound becomes an int through ``int(ndarray of shape [1])``, which numpy >= 2.4
  rejects ("only 0-dimensional arrays can be converted to Python scalars"): read the element;
- ``tl.dot`` on bfloat16 multiplies the raw uint16 bit patterns (numpy has no bf16): widen
  bf16 operands to fp32 first (bf16 products are exact in fp32), as it already does for fp8;
- fp32 -> bf16 / fp16 / e4m3 casts drop the carry of a round-up into the exponent
  (7.82 -> 4.0 in e4m3) and mishandle subnormal outputs, where the GPU rounds to nearest even
  (``cvt.rn``): convert with torch, which rounds the same way;
- ``x.to(tl.bfloat16)`` of an fp32 tensor (``cast_impl``) truncates: round to nearest even, as
  the GPU does (the probabilities before the PV product, the outputs).

Nothing happens without ``TRITON_INTERPRET=1`` or when Triton is not installed; applying twice
is a no-op.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def apply_fixes() -> bool:
    """Patch the interpreter in this process (idempotent). Returns whether it is patched."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original_patch = interpreter._patch_lang_tensor
    if getattr(original_patch, "_flashprefill_fixed", False):
        return True

    def patch_lang_tensor(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._flashprefill_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor

    original_dot = interpreter.InterpreterBuilder.create_dot

    def widen(x):
        if x.dtype != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot

    narrow = {tl.bfloat16: (torch.bfloat16, np.uint16), tl.float16: (torch.float16, np.uint16),
              tl.float8e4nv: (torch.float8_e4m3fn, np.uint8)}
    original_convert = interpreter._convert_float
    rtz = interpreter._ir.ROUNDING_MODE.RTZ

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in narrow and rounding_mode != rtz:
            dtype, bits = narrow[output_dtype]
            x = torch.from_numpy(np.ascontiguousarray(input).view(np.float32).copy())
            if dtype == torch.float8_e4m3fn:
                x = x.clamp(-448.0, 448.0)  # cvt.rn.satfinite
            return x.to(dtype).view(torch.uint8 if bits is np.uint8 else torch.int16).numpy().view(bits)
        return original_convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert_float

    original_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded).astype(np.uint16)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return original_cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    return True


def apply_if_interpreting() -> None:
    if interpreting():
        apply_fixes()


__all__ = ["interpreting", "apply_fixes", "apply_if_interpreting"]
