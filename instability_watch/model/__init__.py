"""What a model is made of: its attention layers (layer.py), the families the watch knows (families.py), where W_q/W_k are (qk.py), sharded weights (sharding.py)."""
