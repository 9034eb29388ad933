"""`maxtext-moe plan MODEL --gpu GPU --nodes N --search [--write FILE.yml]`: the layouts of a model on a
cluster that fit (the planner), ranked by the step-time model, and the chosen one written as a recipe.

MODEL is a recipe (shipped or a file), a model of configs/models (`qwen3-30b-a3b`), or a model YAML (a
`model_file`, as `convert hf-to-maxtext` writes). A model is searched from a GPU template (bf16 weights in
fp32, cuDNN flash attention, synthetic data); a recipe from its own keys. The candidates, per NVLink domain
(one HGX node, or up to a rack of NVL72 trays) and across domains:
- EP x FSDP inside a domain: every split whose EP divides the experts;
- across domains: data parallel (each domain a replica: what fits one domain fits N), FSDP over all of
  them, or FSDP 2 x data parallel the rest;
- the remat policy: full, or every matmul output kept but the experts';
- the micro-batch per GPU: 1, 2, 4, 8 (each larger one only while the smaller fits);
- offload: none, else the optimizer, else the optimizer and parameters (the first that fits).
Each is resolved by MaxText, checked to split every parameter evenly, planned for memory and, when it fits,
timed. A layout is judged by tokens/s per GPU at its own global batch; what it gives up for that is said.
"""

import dataclasses
import functools
import math
import tempfile
from pathlib import Path
from typing import Any

import yaml

from maxtext_moe.config import hardware
from maxtext_moe.config.recipes import configs_dir, list_recipes, recipe_path
from maxtext_moe.errors import UserError

# The keys of a GPU recipe that are not the model's nor the layout's (the shipped HGX recipes' own).
GPU_TEMPLATE = {
  "hardware": "gpu",
  "attention": "cudnn_flash_te",
  "max_segments_per_seq": 32,
  "per_device_batch_size": 1,
  "max_target_length": 4096,
  "dtype": "bfloat16",
  "weight_dtype": "float32",
  "remat_policy": "full",
  "dataset_type": "synthetic",
  "steps": 50,
}
_ATTENTION = ("query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj", "context")
_ATTENTION += ("mla_q", "mla_kv", "query_wa_proj", "kv_wa_proj")
_MLP = ("mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo")
_EXPERTS = ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")
# Two ends of MaxText's remat: `full` (each layer's input kept, its forward run again) and a custom policy
# that keeps every matmul output but the experts' (their GEMMs run again: the largest activations of a MoE
# layer, and the cheapest to recompute per byte kept).
REMATS = {
  "full": ["remat_policy=full"],
  "experts recomputed": ["remat_policy=custom", *(f"{n}=device" for n in _ATTENTION + _MLP)]
  + [f"{n}=remat" for n in _EXPERTS],
}
GIVES_UP = {
  "full": "recomputes every layer's forward (+1/3 FLOPs)",
  "experts recomputed": "recomputes the experts' GEMMs",
}
OFFLOADS = ("none", "optimizer", "optimizer_params")
BATCHES = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Base:
  """What the search starts from: a recipe file and the overrides that make it this cluster's."""

  path: Path
  overrides: list[str]
  keys: dict[str, Any]  # the recipe file's keys to write (a template's, or base_config naming the recipe)
  what: str  # the model as the user named it


@dataclasses.dataclass(frozen=True)
class Layout:
  """One candidate: its overrides and the words for it."""

  ep: int
  fsdp: int
  dcn_fsdp: int
  dcn_data: int
  remat: str
  batch: int
  offload: str = "none"

  def overrides(self) -> list[str]:
    out = [f"ici_expert_parallelism={self.ep}", f"ici_fsdp_parallelism={self.fsdp}"]
    out += [f"dcn_fsdp_parallelism={self.dcn_fsdp}", f"dcn_data_parallelism={self.dcn_data}"]
    out += [*REMATS[self.remat], f"per_device_batch_size={self.batch}", f"offload={self.offload}"]
    return out

  def keys(self) -> dict[str, Any]:
    """The layout as YAML keys (what --write puts in the recipe)."""
    return _keys(self.overrides())

  def gives_up(self) -> str:
    out = [GIVES_UP[self.remat]]
    if self.offload != "none":
      out.append(f"{self.offload.replace('_', ' and ')} in host memory (PCIe/C2C traffic each step)")
    if self.dcn_fsdp > 1:
      out.append(f"weights gathered over the network ({self.dcn_fsdp} domains)")
    return "; ".join(out)


def _model_yaml(path: Path) -> bool:
  try:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
  except (OSError, yaml.YAMLError):
    return False
  return isinstance(data, dict) and "base_config" not in data and "model_name" in data


def _keys(overrides: list[str]) -> dict[str, Any]:
  return {k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in overrides)}


def base_of(model: str, gpu: str | None, nodes: int, overrides: list[str]) -> Base:
  """The search's starting recipe for MODEL on `nodes` nodes of `gpu` (None: a recipe's own), or one line
  saying what is unknown."""
  if gpu is not None and hardware.gpu(gpu) is None:
    known = ", ".join(hardware.GPUS)
    raise UserError(f"unknown GPU '{gpu}'; the planner knows {known}")
  models = sorted(p.stem for p in (configs_dir() / "models").glob("*.yml") if not p.stem.endswith("-from-hf"))
  as_file = Path(model)
  sized = [*overrides, f"nodes={nodes}"]
  if model.removesuffix(".yml") in list_recipes() or (
    as_file.suffix == ".yml" and as_file.is_file() and not _model_yaml(as_file)
  ):
    path = recipe_path(model)
    over = [f"recipe_hardware={gpu}"] if gpu else []
    shipped = path.is_relative_to(configs_dir())
    name = f"${{moe_configs:{path.relative_to(configs_dir())}}}" if shipped else str(path)
    return Base(path, [*over, *sized], {"base_config": name, **_keys(over)}, model)
  if gpu is None:
    raise UserError(f"--search for the model {model} needs --gpu GPU ({', '.join(hardware.GPUS)})")
  if model in models:
    keys = {"base_config": "${moe_configs:base.yml}", "model_name": model, **GPU_TEMPLATE, "recipe_hardware": gpu}
  elif as_file.suffix in (".yml", ".yaml") and as_file.is_file():
    name = yaml.safe_load(as_file.read_text(encoding="utf-8"))["model_name"]
    keys = {"base_config": "${moe_configs:base.yml}", "model_name": name, **GPU_TEMPLATE, "recipe_hardware": gpu}
    keys["model_file"] = str(as_file.resolve())
  else:
    raise UserError(
      f"unknown model '{model}': give a recipe (maxtext-moe recipes), a model of configs/models "
      f"({', '.join(models)}) or a model YAML file (convert hf-to-maxtext writes one)"
    )
  return Base(_template_file(keys), sized, keys, model)


@functools.cache
def _templates() -> tempfile.TemporaryDirectory:
  """A folder for template recipe files, made on the first search and removed when the process ends."""
  return tempfile.TemporaryDirectory(prefix="maxtext-moe-search-")


def _template_file(keys: dict[str, Any]) -> Path:
  """The template as a recipe file MaxText reads."""
  path = Path(_templates().name) / f"{keys['model_name']}-on-{keys['recipe_hardware']}.yml"
  path.write_text(yaml.safe_dump(keys, sort_keys=False), encoding="utf-8")
  return path


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def layouts(gpu: hardware.GpuModel, nodes: int, num_experts: int) -> list[Layout]:
  """Every candidate layout (batch 1, no offload) on `nodes` nodes of `gpu`."""
  g = gpu.gpus_per_node
  per_domain = max(k for k in range(1, nodes + 1) if nodes % k == 0 and k * g <= max(gpu.nvlink_domain, g))
  ici = per_domain * g
  domains = nodes // per_domain
  across = [(1, domains)]
  if domains > 1:
    across.append((domains, 1))
  if domains > 2 and domains % 2 == 0:
    across.append((2, domains // 2))
  out = []
  for ep in _divisors(ici):
    if num_experts % ep:
      continue
    for dcn_fsdp, dcn_data in across:
      out += [Layout(ep, ici // ep, dcn_fsdp, dcn_data, remat, 1) for remat in REMATS]
  return out


@dataclasses.dataclass(frozen=True)
class Found:
  layout: Layout
  device_gib: float
  global_batch: int
  prediction: Any  # steptime.model.Prediction

  def row(self) -> dict[str, Any]:
    return {
      "ep": self.layout.ep,
      "fsdp_per_domain": self.layout.fsdp,
      "fsdp_across": self.layout.dcn_fsdp,
      "data_across": self.layout.dcn_data,
      "remat": self.layout.remat,
      "offload": self.layout.offload,
      "per_device_batch_size": self.layout.batch,
      "global_batch": self.global_batch,
      "device_gib": round(self.device_gib, 1),
      "tflops_per_gpu": round(self.prediction.tflops_per_gpu, 1),
      "tokens_per_s_per_gpu": round(self.prediction.tokens_per_s_per_gpu, 1),
      "gives_up": self.layout.gives_up(),
      "overrides": self.layout.overrides(),
    }


def search(base: Base) -> tuple[list[Found], int, Any]:
  """(the layouts that fit, fastest first; how many were tried; the context of the base)."""
  from maxtext_moe.config.layout import mesh_sizes  # pylint: disable=import-outside-toplevel
  from maxtext_moe.config.nodes import global_batch  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner import divisibility  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.memory_plan import _context, _estimate  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.recipe import predict_config  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import config as upstream_config  # pylint: disable=import-outside-toplevel

  ctx, cfg = _context(str(base.path), base.overrides, None, None)
  gpu = hardware.gpu(cfg.recipe_hardware)
  if gpu is None:
    raise UserError(f"{base.what} runs on CPU here; --search lays a model out on GPUs: pass --gpu GPU")
  found, tried = [], 0
  for start in layouts(gpu, int(cfg.nodes), max(int(cfg.num_experts), 1)):
    for batch in BATCHES:
      fitted = None
      for offload in OFFLOADS:
        layout = dataclasses.replace(start, batch=batch, offload=offload)
        tried += 1
        try:
          cand = upstream_config.resolved(ctx.path, [*ctx.base_overrides, *layout.overrides()])
        except UserError:
          break  # this model cannot take this layout (a check of ours or MaxText's)
        if divisibility.indivisible(ctx.leaves, divisibility.rules_of(cand), mesh_sizes(cand, ctx.num_devices)):
          break
        est, _ = _estimate(ctx, cand, [])
        if est.fits:
          fitted = (layout, cand, est)
          break
      if fitted is None:
        break  # a larger micro-batch needs more memory still
      layout, cand, est = fitted
      label = f"EP {layout.ep} x FSDP {layout.fsdp}"
      batch_total = global_batch(layout.batch, ctx.num_devices, int(cand.gradient_accumulation_steps))
      found.append(Found(layout, est.device_total / 2**30, batch_total, predict_config(ctx, cand, label)))
  return ranked(found), tried, ctx


def ranked(found: list[Found]) -> list[Found]:
  """Fastest first; among layouts within 0.5% of each other, the smaller global batch (the model counts a
  token's cost alike at any micro-batch, and a smaller batch changes the optimization least), then the
  less memory."""
  return sorted(
    found,
    key=lambda f: (-round(math.log(f.prediction.tokens_per_s_per_gpu) / math.log(1.005)), f.global_batch, f.device_gib),
  )


def table(found: list[Found], *, top: int, title: str) -> Any:
  from rich.table import Table  # pylint: disable=import-outside-toplevel

  t = Table(title=title)
  columns = ("#", "EP x FSDP per domain", "across domains", "batch/GPU (global)", "remat", "offload", "GiB/GPU")
  for col in (*columns, "TFLOP/s/GPU", "tokens/s/GPU", "gives up"):
    t.add_column(col, justify="left" if col in ("remat", "offload", "gives up", "across domains") else "right")
  for i, f in enumerate(found[:top], 1):
    lay = f.layout
    across = ", ".join(
      x for x in (f"FSDP {lay.dcn_fsdp}" * (lay.dcn_fsdp > 1), f"data {lay.dcn_data}" * (lay.dcn_data > 1)) if x
    )
    t.add_row(
      str(i), f"{lay.ep} x {lay.fsdp}", across or "-", f"{lay.batch} ({f.global_batch:,})", lay.remat, lay.offload,
      f"{f.device_gib:.1f}", f"{f.prediction.tflops_per_gpu:,.0f}", f"{f.prediction.tokens_per_s_per_gpu:,.0f}",
      lay.gives_up(),
    )  # fmt: skip
  return t


def recipe_text(base: Base, chosen: Found, *, command: str, hbm_gib: float | None) -> str:
  """The chosen layout as a recipe file: the base's keys, then the cluster's and the layout's."""
  pred = chosen.prediction
  header = [
    f"Written by: {command}",
    f"{base.what}: EP {chosen.layout.ep} x FSDP {chosen.layout.fsdp} per NVLink domain, "
    f"{chosen.layout.remat} remat, offload {chosen.layout.offload}, global batch {chosen.global_batch:,} sequences.",
    f"Planned {chosen.device_gib:.1f} GiB per GPU" + (f" of {hbm_gib:.1f} usable" if hbm_gib else "") + "; "
    f"step-time model: {pred.tflops_per_gpu:,.0f} TFLOP/s and {pred.tokens_per_s_per_gpu:,.0f} tokens/s per GPU.",
    "Check it for your GPUs before a run: maxtext-moe compile THIS_FILE (XLA:GPU, any machine).",
    "--nodes N on any command runs it on N nodes (the cross-node axis is the -1 one).",
  ]
  over = _keys([o for o in base.overrides if not o.startswith("nodes=")])
  cross = {"dcn_data_parallelism": -1}  # more nodes: more data-parallel replicas of this layout
  nodes = next(int(o.split("=", 1)[1]) for o in base.overrides if o.startswith("nodes="))
  keys = {**base.keys, **over, "nodes": nodes, **chosen.layout.keys(), **cross}
  body = yaml.safe_dump(keys, sort_keys=False, default_flow_style=False, width=120)
  return "".join(f"# {line}\n" for line in header) + body
