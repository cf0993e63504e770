"""What the user sees: the console (console.py), the run directory (rundir/), the report (report/)."""
