"""MaxText's pipeline stages with MoE layers.

moe_stages.py  the seam: the routing bias carried as a stage's weights, expert loads folded back to layers
records.py     what the layers record per iteration, out of a circular pipeline (repeats > 1)
remat.py       each layer of a stage rematerialized on its own, as it is without stages
flat_load.py   a checkpoint written without stages, loaded into a model with stages
"""
