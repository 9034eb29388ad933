"""MaxText's mesh axis names that the MoE block's parallel layer relies on, written once.

The block itself takes the expert axis as an argument; these are the names MaxText gives its axes
(`mesh_axes` in its base.yml), used where the block is wired to MaxText and to Transformer Engine.
"""

DATA = "data"
FSDP = "fsdp"
EXPERT = "expert"
# TE's NCCL EP splits tokens over (one of these, EXPERT): its dp_resource and fsdp_resource.
TE_EP_OUTER = (DATA, FSDP)
TE_RESOURCES = (DATA, FSDP, EXPERT)  # what TE's MeshResource names dp, fsdp and ep
