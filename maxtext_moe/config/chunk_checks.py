"""`moe_exchange_chunks` against the tokens our block splits into chunks on one device.

The bounded exchange (`moe.rounds`) splits a device's tokens into the chunks only where they divide; where
they do not it runs one chunk, with every buffer the chunk count times larger and nothing beside the GEMMs
(the planner counts the same). A chunk count the user set that does not divide is refused here, one line
with the counts that do; the automatic count (0) keeps the fallback, which the planner counts."""

import math
from typing import Any

from maxtext_moe.config.stage_checks import pipeline_stages
from maxtext_moe.moe.layout import expert_parallelism, layer_counts, mesh_sizes


def block_tokens(cfg: Any, num_devices: int) -> dict[str, int]:
  """Tokens our MoE block holds per device, by where its layers run: the block splits a call's tokens over
  every mesh axis of size > 1 but a surrounding vmap's (the pipeline's `stage`, inside it). A pipelined
  layer sees one microbatch per stage; the MoE layers outside the pipeline (the multi-token prediction
  layer among them) the step's whole batch, split over the stages like data."""
  sequences = int(num_devices * float(cfg.per_device_batch_size))
  seq, stages = int(cfg.max_target_length), pipeline_stages(cfg)
  if stages <= 1:
    return {"each MoE layer": sequences * seq // num_devices}
  micro = int(cfg.num_pipeline_microbatches)
  out = {"a pipelined layer's microbatch": sequences // micro * seq * stages // num_devices}
  if layer_counts(cfg)[1] > int(cfg.pipeline_parallel_layers):  # as MaxText resolved it: the pipelined ones
    out["the MoE layers outside the pipeline"] = sequences * seq // num_devices
  return out


def check_exchange_chunks(cfg: Any, num_devices: int | None = None) -> None:
  """A `moe_exchange_chunks` above 1 divides every device's tokens where our block's exchange runs (the
  recipe's device count, or the job's: `launch.preflight`); nothing is checked where neither is known."""
  chunks = int(getattr(cfg, "moe_exchange_chunks", 0) or 0)
  devices = int(getattr(cfg, "recipe_num_devices", -1)) if num_devices is None else num_devices
  if (
    chunks <= 1
    or devices <= 0
    or str(cfg.moe_impl) != "dropless"
    or int(cfg.num_experts) <= 1
    or str(cfg.moe_dispatch) in ("te_ep", "local")
    or mesh_sizes(cfg, devices).get("expert", expert_parallelism(cfg)) <= 1
  ):
    return
  where = block_tokens(cfg, devices)
  bad = {name: t for name, t in where.items() if t % chunks}
  if not bad:
    return
  common = math.gcd(*where.values())
  fits = sorted((c for c in range(2, min(common, 16) + 1) if common % c == 0), key=lambda c: (abs(c - chunks), c))
  name, tokens = next(iter(bad.items()))
  raise ValueError(
    f"moe_exchange_chunks={chunks} does not divide the {tokens:,} tokens a device holds in {name}, so the "
    f"exchange would run one chunk with {chunks}x the buffers and nothing beside the GEMMs; set "
    + (
      f"moe_exchange_chunks={' or '.join(map(str, sorted(fits[:2])))}, or 0 (auto)"
      if fits
      else "moe_exchange_chunks=0 (auto)"
    )
  )
