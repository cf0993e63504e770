"""The framework-free engine: InstabilityWatch (watch.py), a facade over the parts in this folder."""
