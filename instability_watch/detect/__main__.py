"""``python -m instability_watch.detect``: print the README's alert table (Markdown) on stdout."""
from instability_watch.detect.kinds import alert_table_markdown

print(alert_table_markdown())
