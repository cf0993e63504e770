"""``python -m instability_watch.alerts``: print the README's alert table (Markdown) on stdout."""
from . import alert_table_markdown

print(alert_table_markdown())
