import pytest
import torch


def _fix_triton_interpreter() -> None:
    """Three bugs of triton 3.6's CPU interpreter (TRITON_INTERPRET=1), not of the kernels
    (compiled Triton on a GPU has neither):
    - a tensor loop bound becomes an int through ``int(ndarray of shape [1])``, which
      numpy >= 2.4 rejects: read the element instead;
    - ``tl.dot`` on bfloat16 multiplies the raw uint16 bit patterns (numpy has no bf16):
      widen bf16 operands to fp32 first, as the interpreter already does for fp8;
    - fp32 -> bf16/fp16/e4m3 casts lose the rounding carry (see ``convert_float`` below)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original_patch = interpreter._patch_lang_tensor
    if getattr(original_patch, "_fixed", False):
        return

    def patch_lang_tensor(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._fixed = True
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

    # fp32 -> bf16 / fp16 / e4m3 downcasts: the interpreter's bit manipulation drops the carry
    # of a round-up into the exponent (7.82 -> 4.0 in e4m3) and mishandles subnormal outputs;
    # the GPU rounds to nearest even (cvt.rn). Use torch's conversion, which does the same.
    narrow = {tl.bfloat16: (torch.bfloat16, np.uint16), tl.float16: (torch.float16, np.uint16),
              tl.float8e4nv: (torch.float8_e4m3fn, np.uint8)}
    original_convert = interpreter._convert_float

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in narrow and rounding_mode != interpreter._ir.ROUNDING_MODE.RTZ:
            dtype, bits = narrow[output_dtype]
            x = torch.from_numpy(np.ascontiguousarray(input).view(np.float32).copy())
            if dtype == torch.float8_e4m3fn:
                x = x.clamp(-448.0, 448.0)  # cvt.rn.satfinite
            return x.to(dtype).view(torch.uint8 if bits is np.uint8 else torch.int16).numpy().view(bits)
        return original_convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert_float


_fix_triton_interpreter()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
