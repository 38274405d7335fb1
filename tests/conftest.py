import pytest
import torch

from kernels.triton_interpreter import apply_if_interpreting


# The interpreter's fixes live in the library (kernels/triton_interpreter.py) and are applied
# when a kernels.triton_* module is imported under TRITON_INTERPRET=1; applying them here too
# covers tests that launch their own Triton kernels before importing one.
apply_if_interpreting()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
