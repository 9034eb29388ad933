"""The Transformer Engine seam (transformer-engine 2.20.2, JAX side). It imports nothing of ours, so the
MoE math (`moe/`) may call it.

  calls.py           every TE call: its grouped GEMM and NCCL EP
  compile_target.py  TE answered for a GPU that is not there (`maxtext-moe compile` only)
  manifest.py        every TE symbol calls.py and compile_target.py use, checked against manifest.json
  sources.py         signatures read from a TE distribution's Python sources, without importing it
"""
