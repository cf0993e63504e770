"""Our attention: the PyTorch emulation (``reference.py``), the Triton kernels (``triton*.py``), the Gluon kernels
at D = 256 on Hopper (``gluon*.py``), and the ``torch.library`` ops and autograd over them (``ops.py``).
The public entry point is :func:`instability_watch.kernels.flash_attention`."""
