"""Watching a run: live metrics (metrics.py) and progress (progress.py), the run report
(report.py) and its plot (report_plot.py), and the machine it ran on (machine.py)."""
