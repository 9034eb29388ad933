"""The optimizer update's memory when its state lives on the host (`offload: optimizer`, `optimizer_params`):
MaxText's train step moves the Adam state (and offloaded parameters) to the device for the update, and
XLA:GPU starts every leaf's host copies together (`of`)."""


def of(*, params: int, grads: int, optimizer: int) -> int:
  """The optimizer update's bytes: the whole train state at once (`params`, `grads`, the `optimizer` state).
  Each leaf's update is one fusion whose outputs take its inputs' place and nothing orders the leaves after
  one another, so XLA:GPU starts every leaf's host copies together. Its scheduler may hold fewer in flight
  when its memory target (slop x (memory - arguments), `GetSchedulerMemoryLimit`) is below the whole state,
  but need not, and the planner does not count on it: the 671B on 32 H100 nodes (EP 8 x 2 nodes, FSDP 8,
  data 2, batch 2, both offloaded) holds all 12 of its float32 expert stacks, 77.9 GiB compiled, against
  targets of 61.9 (our profiles' slop, 85%) and 69.1 (XLA's default, 95%) that one leaf in flight would
  meet; gb200-nvl72/deepseek3-671b staggers them, 143.1 GiB of its 159.1 (docs/planner.md)."""
  return params + grads + optimizer
