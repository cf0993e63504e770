"""What is measured, on the device: the probe rows (fields.py), the per-layer buffers (bank.py), sigma(W_Q) (spectral.py)."""
