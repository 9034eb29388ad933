"""The optimizer update's memory when its state lives on the host (`offload: optimizer`, `optimizer_params`):
MaxText's train step moves the Adam state (and offloaded parameters) to the device for the update, and
XLA:GPU starts every leaf's host copies together (`of`)."""


def of(*, params: int, grads: int, optimizer: int) -> int:
  """The optimizer update's bytes: the whole train state at once (`params`, `grads`, the `optimizer` state).
  Each leaf's update is one fusion whose outputs take its inputs' place and nothing orders the leaves after
  one another, so XLA:GPU starts every leaf's host copies together. Its scheduler may hold fewer in flight
  when its memory target (slop x (memory - arguments), `GetSchedulerMemoryLimit`) is below the whole state,
  but need not, and the planner does not count on it: the 671B on 32 H100 nodes (EP 8 x 2 nodes, FSDP 8,
  data 2, batch 2, both offloaded) holds all 12 of its float32 expert stacks, 77.6 GiB live, against a
  target of 69.1 that one leaf in flight would meet (57 GiB); gb200-nvl72/deepseek3-671b, whose target
  (161.1) is above its state (159.1), holds it all (158.9 compiled), and held 130.1 only when compiled for
  80% of its memory (target 128.9)."""
  return params + grads + optimizer
