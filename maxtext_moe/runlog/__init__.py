"""A run's outputs: the metrics and load files, live progress, the plots and one summary.

files.py     metrics.jsonl and moe_load.jsonl: their rows, read and (atomically) rewritten
progress.py  one line per step, or a rich progress bar on a terminal
plots.py     loss.png, moe_load.png, moe_balance.png
summary.py   the run's summary, at the end of `train` and from `maxtext-moe report`
recorder.py  `RunRecorder`: what MaxText's logger hands each step, written as it comes
report.py    `maxtext-moe report RUN_DIR`: pictures and summary from the files alone
"""
