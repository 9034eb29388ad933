"""The memory planner (`maxtext-moe plan`): `estimate.py` is the per-device memory model (a layer's backward
in `layer_phase.py`, pipeline stages in `stages.py`), `memory_plan.py` the fit verdict and the search for
the cheapest fix. `maxtext-moe bench plan` checks the model against XLA's compiled `memory_analysis()`."""
