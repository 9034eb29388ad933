"""`maxtext-moe plan MODEL --gpu GPU --nodes N --search [--write FILE.yml]`: the layouts of a model on a
cluster that fit (the planner), ranked by the step-time model, and the chosen one written as a recipe.

MODEL is a recipe (shipped or a file), a model of configs/models (`qwen3-30b-a3b`), or a model YAML (a
`model_file`, as `convert hf-to-maxtext` writes). A model is searched from a GPU template (bf16 weights in
fp32, cuDNN flash attention, synthetic data); a recipe from its own keys. The candidates are
`candidates.py`'s. Each is resolved by MaxText, checked to split every parameter evenly, planned for memory
and, when it fits, timed. A layout is judged by tokens/s per GPU at its own global batch; what it gives up
for that is said.

MaxText's resolution (about a second each) is the search's cost, so it is spared where the answer is
known: a larger micro-batch starts from the offload its smaller one needed (memory only grows with the
batch), the custom remat from what `full` needed at the same layout and batch (it keeps everything `full`
keeps), and within one candidate as `fitting.py` says.
"""

import dataclasses
import functools
import math
import tempfile
from pathlib import Path
from typing import Any

import yaml

from maxtext_moe.config import checkpointing, hardware
from maxtext_moe.config.recipes import configs_dir, list_recipes, recipe_path
from maxtext_moe.errors import UserError
from maxtext_moe.planner.estimate import EDGE
from maxtext_moe.steptime import fitting
from maxtext_moe.steptime.candidates import BATCHES, OFFLOADS, TENSOR, Layout, keys_of, layouts
from maxtext_moe.steptime.fitting import Found

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


@dataclasses.dataclass(frozen=True)
class Base:
  """What the search starts from: a recipe file and the overrides that make it this cluster's."""

  path: Path
  overrides: list[str]
  keys: dict[str, Any]  # the recipe file's keys to write (a template's, or base_config naming the recipe)
  what: str  # the model as the user named it


def _model_yaml(path: Path) -> bool:
  try:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
  except (OSError, yaml.YAMLError):
    return False
  return isinstance(data, dict) and "base_config" not in data and "model_name" in data


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
    return Base(path, [*over, *sized], {"base_config": name, **keys_of(over)}, model)
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


def default_of(model: str, gpu: str, nodes: int, overrides: list[str]) -> tuple[Base, str]:
  """`plan MODEL --gpu GPU --nodes N` without --search: (the recipe to plan, the words for it). A recipe
  given is planned on GPU; a model of configs/models or a model file on its shipped recipe for GPU where
  there is one, else on the template with a default layout (`_default_layout`); `overrides` win."""
  shipped = [r for r in list_recipes() if r.rsplit("/", 1)[-1] == model and _recipe_gpu(r) == gpu]
  if shipped:
    words = f"the recipe {shipped[0]}" + ", your overrides on top" * bool(overrides)
    return Base(recipe_path(shipped[0]), [*overrides, f"nodes={nodes}"], {}, shipped[0]), words
  base = base_of(model, gpu, nodes, overrides)
  if base.keys.get("model_name") is None:  # a recipe (its keys name only its base_config): its own layout
    return base, f"the recipe {model} on {gpu}"
  lay = _default_layout(base, hardware.gpu(gpu), nodes)
  words = f"a default layout, EP {lay.ep} x FSDP {lay.fsdp} per NVLink domain" + (
    f", FSDP {lay.dcn_fsdp} across domains" * (lay.dcn_fsdp > 1)
  )
  words += ", full remat, one sequence per GPU, nothing offloaded" + ", your overrides on top" * bool(overrides)
  words += " ('plan ... --search' finds the fastest)"
  return dataclasses.replace(base, overrides=[*lay.overrides(), *base.overrides], what=f"{model} on {gpu}"), words


def _recipe_gpu(name: str) -> str | None:
  """A shipped recipe's `recipe_hardware`, from its own file."""
  data = yaml.safe_load(recipe_path(name).read_text(encoding="utf-8"))
  return data.get("recipe_hardware") if isinstance(data, dict) else None


def _default_layout(base: Base, gpu: hardware.GpuModel, nodes: int) -> Layout:
  """The shipped HGX recipes' shape: the largest EP inside an NVLink domain that divides the experts, FSDP
  the rest of the domain and across domains, full remat, one sequence per GPU, nothing offloaded."""
  from maxtext_moe.planner.planning import resolved  # pylint: disable=import-outside-toplevel

  experts = max(int(resolved(base.path, base.overrides).num_experts), 1)
  return max(
    (c for c in layouts(gpu, nodes, experts) if c.stages == 1 and c.dcn_ep == 1 and c.dcn_data == 1),
    key=lambda c: (c.remat == "full", c.ep, c.dcn_fsdp),
  )


@functools.cache
def _templates() -> tempfile.TemporaryDirectory:
  """A folder for template recipe files, made on the first search and removed when the process ends."""
  return tempfile.TemporaryDirectory(prefix="maxtext-moe-search-")


def _template_file(keys: dict[str, Any]) -> Path:
  """The template as a recipe file MaxText reads."""
  path = Path(_templates().name) / f"{keys['model_name']}-on-{keys['recipe_hardware']}.yml"
  path.write_text(yaml.safe_dump(keys, sort_keys=False), encoding="utf-8")
  return path


def search(base: Base, *, tensor: bool = False, network_gbs: float | None = None) -> tuple[list[Found], int, Any]:
  """(the layouts that fit, fastest first; how many MaxText resolved; the context of the base); with
  `tensor`, tensor parallelism 2 and 4 too (left out by default: XLA:GPU's programs of our block under it
  move far more than the model counts, docs/step-time.md); `network_gbs`: the fabric's GB/s per GPU."""
  from maxtext_moe.planner.planning import planning  # pylint: disable=import-outside-toplevel

  ctx, cfg = planning(str(base.path), base.overrides, None, None, network_gbs=network_gbs)
  gpu = hardware.gpu(cfg.recipe_hardware)
  if gpu is None:
    raise UserError(f"{base.what} runs on CPU here; --search lays a model out on GPUs: pass --gpu GPU")
  found, tried = [], 0
  floors: dict[Layout, int] = {}  # (a layout under full remat, at a batch) -> the offload that fit it
  groups = int(cfg.n_routing_groups or -1)
  heads = (int(cfg.num_query_heads), int(cfg.num_kv_heads))
  tensor = tuple(t for t in TENSOR if all(h % t == 0 for h in heads)) if tensor else (1,)
  every = layouts(
    gpu,
    int(cfg.nodes),
    max(int(cfg.num_experts), 1),
    moe_layers=fitting.pipelinable(cfg),
    routing_groups=groups,
    tensor=tensor,
  )
  for start in every:
    first, half = 0, None
    for batch in BATCHES:  # each twice the one before
      full = dataclasses.replace(start, remat="full", batch=batch)
      first = max(first, floors.get(full, 0) if start.remat != "full" else 0)
      if first >= len(OFFLOADS):
        break  # full remat did not fit: keeping more does not either
      fitted, resolved = fitting.first_fit(ctx, cfg, dataclasses.replace(start, batch=batch), first, half)
      tried += resolved
      if start.remat == "full":
        floors[full] = OFFLOADS.index(fitted[0].offload) if fitted else len(OFFLOADS)
      if fitted is None:
        break  # a larger micro-batch needs more memory still
      first, half = OFFLOADS.index(fitted[0].offload), fitted[2]
      found.append(fitting.timed(ctx, *fitted))
  return ranked(found, ctx.hbm_gib), tried, ctx


def at_edge(f: Found, hbm_gib: float | None) -> bool:
  """Whether `f` is planned within EDGE of the usable memory (`estimate.EDGE`)."""
  return hbm_gib is not None and f.device_gib > (1 - EDGE) * hbm_gib


def ranked(found: list[Found], hbm_gib: float | None = None) -> list[Found]:
  """Fastest first, the layouts at the memory's edge (`at_edge`) after the rest; among layouts within 0.5% of
  each other, the smaller global batch (the model counts a token's cost alike at any micro-batch, and a
  smaller batch changes the optimization least), then the less memory."""
  return sorted(
    found,
    key=lambda f: (
      at_edge(f, hbm_gib),
      -round(math.log(f.prediction.tokens_per_s_per_gpu) / math.log(1.005)),
      f.global_batch,
      f.device_gib,
    ),
  )


def table(
  found: list[Found], *, top: int, title: str, verified: list | None = None, hbm_gib: float | None = None
) -> Any:
  """The ranked layouts; with `verified` (`gpu_compile.verify.Verified`, `plan --verify`) the GiB XLA:GPU
  compiled each to beside the planner's; a layout at the memory's edge says so (`at_edge`)."""
  from rich.table import Table  # pylint: disable=import-outside-toplevel

  compiled = {id(v.found): v for v in verified or []}
  caption = (
    "Layouts within 0.5% of each other's tokens/s are ranked by the smaller global batch, then the less memory: "
    "the model cannot tell them apart, and a smaller batch changes the optimization least. Layouts planned "
    f"within {EDGE:.0%} of the usable memory come after the rest: there XLA's buffer packing decides (--verify)."
  )
  t = Table(title=title, caption=caption)
  columns = ("#", "EP x FSDP (x TP) per domain", "across domains", "stages", "microbatches", "batch/GPU (global)")
  columns += ("remat", "offload", "GiB/GPU") + (("compiled GiB",) if compiled else ())
  for col in (*columns, "TFLOP/s/GPU", "tokens/s/GPU", "gives up"):
    t.add_column(col, justify="left" if col in ("remat", "offload", "gives up", "across domains") else "right")
  for i, f in enumerate(found[:top], 1):
    lay = f.layout
    parts = (f"EP {lay.dcn_ep}" * (lay.dcn_ep > 1), f"FSDP {lay.dcn_fsdp}" * (lay.dcn_fsdp > 1))
    across = ", ".join(x for x in (*parts, f"data {lay.dcn_data}" * (lay.dcn_data > 1)) if x)
    staged = lay.stages > 1
    t.add_row(
      str(i), f"{lay.ep} x {lay.fsdp}" + f" x TP {lay.tp}" * (lay.tp > 1), across or "-",
      (f"{lay.stages}" + f" x {lay.repeats} repeats" * (lay.repeats > 1)) if staged else "-",
      f"{lay.microbatches} ({lay.bubble:.1%} bubble)" if staged else "-", f"{lay.batch} ({f.global_batch:,})",
      lay.remat, lay.offload, f"{f.device_gib:.1f}", *([_compiled_cell(compiled.get(id(f)))] if compiled else []),
      f"{f.prediction.tflops_per_gpu:,.0f}", f"{f.prediction.tokens_per_s_per_gpu:,.0f}",
      ("at the memory's edge (compile decides); " if at_edge(f, hbm_gib) else "") + lay.gives_up(),
    )  # fmt: skip
  return t


def _compiled_cell(v: Any) -> str:
  """A layout's compiled GiB and verdict in the table ('-': not compiled)."""
  if v is None:
    return "-"
  if v.compiled_gib is None:
    return "did not compile"
  return f"{v.compiled_gib:.1f} " + ("fits" if v.fits else "DOES NOT FIT")


def recipe_text(
  base: Base, chosen: Found, *, command: str, hbm_gib: float | None, compiled: dict[str, Any] | None = None
) -> str:
  """The chosen layout as a recipe file: the base's keys, then the cluster's and the layout's; `compiled`:
  what `--verify`'s compile of this very file found (`gpu_compile.verify.Verified.row`), said in the header."""
  pred, lay = chosen.prediction, chosen.layout
  stages = f", {lay.stages} pipeline stages of {lay.per_stage} layers" + f" x {lay.repeats} repeats" * (lay.repeats > 1)
  stages = (stages + f" x {lay.microbatches} microbatches") * (lay.stages > 1)
  header = [
    f"Written by: {command}",
    f"{base.what}: EP {lay.ep} x FSDP {lay.fsdp}"
    + f" x TP {lay.tp}" * (lay.tp > 1)
    + f" per NVLink domain{stages}"
    + (f", EP {lay.dcn_ep} across domains" if lay.dcn_ep > 1 else "")
    + ", "
    f"{lay.remat} remat, offload {lay.offload}, global batch {chosen.global_batch:,} sequences.",
    f"Planned {chosen.device_gib:.1f} GiB per GPU" + (f" of {hbm_gib:.1f} usable" if hbm_gib else "") + "; "
    f"step-time model: {pred.tflops_per_gpu:,.0f} TFLOP/s and {pred.tokens_per_s_per_gpu:,.0f} tokens/s per GPU.",
    (
      f"Compiled by XLA:GPU (plan --verify): {compiled['compiled_gib']:.1f} GiB per GPU of "
      f"{compiled['usable_gib']:.1f} usable. Compile it again after a change: maxtext-moe compile THIS_FILE."
      if compiled
      else "Check it for your GPUs before a run: maxtext-moe compile THIS_FILE (XLA:GPU, any machine)."
    ),
    "--nodes N on any command runs it on N nodes (the cross-node axis is the -1 one).",
    f"checkpoint_period: about {checkpointing.MINUTES} minutes of steps at the model's {pred.step_s:.2f} s a step "
    "(a failure costs at most that).",
  ]
  over = keys_of([o for o in base.overrides if not o.startswith("nodes=")])
  cross = {"dcn_data_parallelism": -1}  # more nodes: more data-parallel replicas of this layout
  nodes = next(int(o.split("=", 1)[1]) for o in base.overrides if o.startswith("nodes="))
  period = {"checkpoint_period": checkpointing.period_for(pred.step_s)}  # a base's own period stays
  keys = {**period, **base.keys, **over, "nodes": nodes, **chosen.layout.keys(), **cross}
  body = yaml.safe_dump(keys, sort_keys=False, default_flow_style=False, width=120)
  return "".join(f"# {line}\n" for line in header) + body
