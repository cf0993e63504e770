"""What the watch does about an alert: the rule (policy.py), switching heads (switching.py), QK-clip (qkclip.py), the events (events.py)."""
