"""One process of tests/test_gpu_path.py::test_te_ep_matches_all_to_all_across_processes: joins a
localhost JAX cluster (one GPU per process), runs the MoE block with te_ep and with all_to_all on the same
global tokens, and writes how far apart their outputs and gradients are.

  python tests/gpu_ep_worker.py RANK WORLD OUT.json
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from maxtext_moe.moe.block import moe_block
from maxtext_moe.moe.mesh_axes import TE_RESOURCES
from maxtext_moe.moe.settings import DispatchKind, GemmBackend, MoESettings
from maxtext_moe.upstream.te import calls as te

T_PER_RANK, D, F, E, K = 256, 512, 256, 16, 4


def main(rank: int, world: int, out: str) -> None:
  jax.distributed.initialize("localhost:12355", num_processes=world, process_id=rank)
  mesh = Mesh(np.array(jax.devices()).reshape(1, world), ("fsdp", "expert"))
  t = T_PER_RANK * world
  k = jax.random.split(jax.random.PRNGKey(0), 6)  # the same global arrays on every process
  x = jax.random.normal(k[0], (t, D), jnp.bfloat16)
  ids = jnp.argsort(jax.random.uniform(k[1], (t, E)), axis=-1)[:, :K].astype(jnp.int32)
  weights = jax.nn.softmax(jax.random.normal(k[2], (t, K)), axis=-1)
  w = tuple(
    (jax.random.normal(key, shape) / 8).astype(jnp.bfloat16)
    for key, shape in zip(k[3:], ((E, D, F), (E, D, F), (E, F, D)), strict=True)
  )
  capacity = te.recv_capacity(num_experts=E, top_k=K, tokens_per_rank=T_PER_RANK, ep_size=world, factor=0)
  te.bootstrap(
    mesh, axes=TE_RESOURCES, num_experts=E, tokens_per_rank=T_PER_RANK, capacity=capacity, hidden_dim=D, drop=False
  )

  def run(dispatch):
    settings = MoESettings(dispatch=dispatch, gemm=GemmBackend.TE, te_recv_capacity=capacity)

    def loss(x, *w):
      y, stats = moe_block(x, ids, weights, *w, mesh=mesh, expert_axis="expert", settings=settings)
      return jnp.sum(y.astype(jnp.float32) ** 2), (y, stats)

    with jax.set_mesh(mesh), te.shard_guard(TE_RESOURCES):
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, *w)

  (_, (y_te, s_te)), g_te = run(DispatchKind.TE_EP)
  (_, (y_ref, s_ref)), g_ref = run(DispatchKind.ALL_TO_ALL)
  gather = jax.experimental.multihost_utils.process_allgather
  diff = lambda a, b: float(np.max(np.abs(np.asarray(gather(a), np.float32) - np.asarray(gather(b), np.float32))))  # noqa: E731
  result = {
    "max_abs_diff_out": diff(y_te, y_ref),
    "max_abs_diff_grad": max(diff(a, b) for a, b in zip(g_te, g_ref, strict=True)),
    "dropped": float(s_te["dropped"]),
    "load_equal": bool(np.array_equal(np.asarray(gather(s_te["load"])), np.asarray(gather(s_ref["load"])))),
  }
  with open(out, "w", encoding="utf-8") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
