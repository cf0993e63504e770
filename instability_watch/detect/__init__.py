"""Early warning: the alert kinds (kinds.py) and the rules that raise them (detectors.py)."""
