"""Watching the user's own attention calls: the SDPA observer (sdpa.py), the watched layers (observation.py), coverage (coverage.py)."""
