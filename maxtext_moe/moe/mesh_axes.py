"""MaxText's mesh axis names that the MoE block's parallel layer relies on, written once.

The block itself takes the expert axis as an argument; these are the names MaxText gives its axes
(`mesh_axes` in its base.yml), used where the block is wired to MaxText and to Transformer Engine.
"""

DATA = "data"
FSDP = "fsdp"
EXPERT = "expert"
STAGE = "stage"  # MaxText's pipeline stages
# TE's NCCL EP splits tokens over (one of these, EXPERT): its dp_resource and fsdp_resource.
TE_EP_OUTER = (DATA, FSDP)
TE_RESOURCES = (DATA, FSDP, EXPERT)  # what TE's MeshResource names dp, fsdp and ep


def te_ep_layout_problem(axis_sizes: dict[str, int], *, num_experts: int, expert_axis: str = EXPERT) -> str | None:
  """Why TE's NCCL EP cannot serve this mesh (one line, with the fix), or None. It splits tokens over (one
  of data or fsdp, expert) and nothing else: its leading spec is (outer, ep). `num_experts` 0: unchecked."""
  ep = axis_sizes.get(expert_axis, 1)
  others = {a: n for a, n in axis_sizes.items() if n > 1 and a != expert_axis}
  outer = [a for a in others if a in TE_EP_OUTER]
  if ep < 2:
    return f"moe_dispatch=te_ep needs expert parallelism of at least 2, got {ep}; use local or auto"
  if num_experts and num_experts % ep:
    return f"moe_dispatch=te_ep needs the {num_experts} experts to divide evenly over EP={ep}"
  if others.get(STAGE, 1) > 1:
    return (
      f"moe_dispatch=te_ep does not run inside pipeline stages ({others[STAGE]}): TE's NCCL EP is not vmapped "
      "over the stages; use moe_dispatch=auto (all_to_all under stages)"
    )
  if len(outer) > 1 or len(others) > len(outer):
    layout = ", ".join(f"{a}={n}" for a, n in others.items())
    return (
      f"moe_dispatch=te_ep splits tokens over expert and at most one of data or fsdp, not {layout}; "
      "fold the rest into fsdp, or use moe_dispatch=auto (all_to_all for this layout)"
    )
  return None


def check_te_ep_layout(axis_sizes: dict[str, int], *, num_experts: int, expert_axis: str = EXPERT) -> None:
  """Raises ValueError with `te_ep_layout_problem`'s line for a layout TE's NCCL EP cannot serve."""
  problem = te_ep_layout_problem(axis_sizes, num_experts=num_experts, expert_axis=expert_axis)
  if problem:
    raise ValueError(problem)
