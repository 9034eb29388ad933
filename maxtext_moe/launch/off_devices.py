"""`train --check` of a GPU recipe where its GPUs are not (a login node): everything that needs no device,
the memory plan, and the step-time model's minutes between checkpoints; what needs the devices is named."""

from collections.abc import Callable
from typing import Any

from maxtext_moe.config import checkpointing, checks
from maxtext_moe.errors import UserError
from maxtext_moe.launch.preflight import check_inputs

# What `train --check` cannot check off the job's GPUs: each runs when the job starts.
SKIPPED_OFF_DEVICES = (
  "the devices each process sees and their NVLink domains",
  "the platform's host memory for offload",
  "Transformer Engine and NCCL EP in the image",
)


def check(
  cfg: Any, name: str, recipe: Any, overrides: list[str], check_resume_layout: Callable[[Any], None]
) -> dict[str, Any]:
  """`train --check` of a GPU recipe off its GPUs: every check that needs no device (the config, the
  layout on the recipe's device count, the paths, data and tokenizer, MaxText's own assertions, a resume's
  layout, by `check_resume_layout`) and the memory plan, which must fit; what needs the devices is named as
  skipped."""
  from maxtext_moe.cluster import fit  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.recipe import for_recipe  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext import trainer  # pylint: disable=import-outside-toplevel

  want = int(cfg.recipe_num_devices)
  try:
    checks.check_layout_fits_devices(cfg, num_devices=want)
  except ValueError as e:
    raise UserError(str(e)) from e
  check_inputs(cfg)
  trainer.validate(cfg)
  check_resume_layout(cfg)
  verdict = fit.check(name, overrides, job=cfg)  # every tensor divides (as check_layout_divides) and it fits
  est = verdict.plan.base
  step_s = for_recipe(name, overrides, planned=verdict.planned).step_s  # the same resolution
  return {
    "recipe": recipe.path.stem,
    "devices": want,
    "processes": want,
    "off_devices": True,
    "plan": f"{est.device_total / 2**30:.1f} GiB per GPU of {est.hbm / 2**30:.1f} by the planner",
    "at_risk": checkpointing.at_risk(cfg, step_s),
    "skipped": list(SKIPPED_OFF_DEVICES),
  }
