import pytest
import torch


def _fix_triton_interpreter() -> None:
    """Two bugs of triton 3.6's CPU interpreter (TRITON_INTERPRET=1), not of the kernels
    (compiled Triton on a GPU has neither):
    - a tensor loop bound becomes an int through ``int(ndarray of shape [1])``, which
      numpy >= 2.4 rejects: read the element instead;
    - ``tl.dot`` on bfloat16 multiplies the raw uint16 bit patterns (numpy has no bf16):
      widen bf16 operands to fp32 first, as the interpreter already does for fp8."""
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


_fix_triton_interpreter()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
