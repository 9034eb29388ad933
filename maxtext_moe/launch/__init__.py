"""The run lifecycle of `maxtext-moe train`: from a recipe to MaxText's trainer and back.

train.py        read the recipe (upstream.resolution), apply its environment, join the job, resolve, run
preflight.py    the checks once the backend is up, before anything is compiled or written
environment.py  the flag profile's environment put into effect in this process
interrupts.py   SIGTERM/SIGINT: finish the step, save, stop
outcome.py      how a run that ended early is reported (one line, an exit code)
"""
