import os

import pytest
import torch

if not torch.cuda.is_available():
    # CPU machines test the Triton kernels through Triton's interpreter, with a
    # shim that gives it GPU-like BF16 arithmetic. The kernels are defined on
    # first use, after this, so they come out interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from triton_interp_bf16 import install
    except ImportError:  # triton missing: the tests that need it skip themselves
        pass
    else:
        install()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where CUDA is available (the lent GPU machine)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
