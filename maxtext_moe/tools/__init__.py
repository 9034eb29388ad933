"""Commands beside the run lifecycle.

doctor.py    `maxtext-moe doctor`: what this machine offers the MoE block and what `auto` picks
show.py      `maxtext-moe config`: the resolved config and what our layers changed
evaluate.py  `maxtext-moe eval`: held-out completion loss and greedy exact match of a checkpoint
"""
