import os

# One intra-op thread for the tests (and, through the environment, the processes they start).
# Their tensors are tiny, so a second thread gains nothing; but on a 2-core machine shared with
# other work (or with a test's own 2-process run) OpenMP's barriers wait for a descheduled thread
# on every op: test_observe.py's training tests took 57 s with 2 threads beside two busy
# processes, 11 s with one. Set before torch starts its thread pool; an explicit setting wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # torch may have started before this file

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
    """Tests marked ``gpu`` run only where CUDA is available (the lent GPU machine). Every test in a file named
    ``test_*_gpu.py`` is marked ``gpu`` (the layout selects them: ``pytest -m gpu`` runs every GPU test)."""
    for item in items:
        if item.path.name.endswith("_gpu.py"):
            item.add_marker(pytest.mark.gpu)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
