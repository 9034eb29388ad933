"""The step-time model (`maxtext-moe plan RECIPE --time`, `bench timemodel`): one training step's time on a
GPU from the work it does, beside the memory planner (`planner/`), whose saved-activation and state counts
it reads.

model.py      Transfer, Workload, Prediction; `predict` adds the parts up, `format_prediction` prints them
links.py      the NIC and NVLink a transfer crosses, and how long each is busy in a step
workload.py   the Workload of a resolved MaxText config (FLOPs, formats, collectives, host copies)
fsdp.py       the parameters' collectives: FSDP gathers, gradient reduce-scatters and all-reduces
stage_costs.py  pipeline stages: the pipelined layers' GEMMs, the stage sends, the bubble's terms
counts.py     per-token counts: the GEMMs' shapes, what remat recomputes, the memory-bound ops' bytes
recipe.py     for a recipe: `for_recipe`, `predict_config`, `with_compiled` (XLA:GPU's collectives)
constants.py  every constant with its source (none fitted to a point `bench timemodel` checks)
gemm.py       GEMM efficiency by shape and format (XLA:GPU's measured matmul table, xla_matmul.json)
latency.py    a collective's latency per launch (NCCL's tuning model)
launch.py     kernel launch gaps in and outside command buffers / CUDA graphs
imbalance.py  routing imbalance: max/mean rows per EP rank, measured from a run's moe_load.jsonl
external.py   other frameworks' published layouts (Megatron, NeMo) as Workloads
points.py     the published points `bench timemodel` checks
search.py     the layout search (`plan MODEL --search`): the fastest layout that fits
candidates.py the search's candidate layouts (pipeline stages among them)
fitting.py    whether a candidate fits, with as few MaxText resolutions as the answer needs, and its time
"""
