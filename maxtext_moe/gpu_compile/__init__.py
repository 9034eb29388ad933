"""Compiling a GPU recipe's train step without a GPU (`maxtext-moe compile RECIPE`): XLA:GPU's own program,
for the recipe's GPU model at its full device count, on compile-only devices (docs/gpu-path.md).

- `command`: the command: reads the recipe as `train` does, applies `stand_ins`, builds the devices and
  mesh, compiles, and hands the compiled program to `report`.
- `stand_ins`: what cannot be compiled on this machine as the container runs it, replaced and said (one
  list, each with its reason): TE's kernels where TE does not import, TE's cuDNN attention.
- `report`: per GPU memory beside the planner's, collectives, host transfers and syncs, GEMM kinds and
  number formats, the schedule; `hlo` reads them from the optimized HLO text, `schedule` what runs beside
  what (the expert exchange beside a GEMM), `gemms` names each GEMM's
  kind and format, `peak` the live set at the memory peak (`--hlo DIR`).
- `te_libraries`: TE's CUDA libraries loaded against a stub driver (`.venv-te`); `nccl_ep`: the size of
  TE NCCL EP's dispatch handle, from the group's sizes.
- In the seams, since only they may import MaxText and TE: `upstream.maxtext.compile` (MaxText's train step built
  and compiled, the compile-only devices and mesh) and `upstream.te_target` (TE answered for the target:
  its compute capability, its NCCL EP bootstrapped without NCCL).
"""
