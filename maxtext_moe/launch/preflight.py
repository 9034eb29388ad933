"""Checks made once the backend is up and the config resolved, before anything is compiled or written:
one line each, with the fix."""

import sys
from pathlib import Path
from typing import Any

from maxtext_moe.config import checks
from maxtext_moe.config.quantization import quantization_name
from maxtext_moe.errors import UserError
from maxtext_moe.moe.layout import expert_nodes, expert_parallelism


def _device_hint(cfg: Any, *, visible: int, processes: int) -> str:
  """How to make the job's devices and the recipe's layout agree."""
  from maxtext_moe.config.nodes import gpus_per_node  # pylint: disable=import-outside-toplevel

  per_node = gpus_per_node(cfg.recipe_hardware, int(cfg.gpus_per_node))
  if per_node and visible % per_node == 0:
    return (
      f"; the job has {visible // per_node} node(s) of {per_node} GPUs: pass --nodes {visible // per_node} "
      "(nodes=N), with one process per GPU"
    )
  if cfg.hardware == "cpu" and processes == 1:
    return f"; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={cfg.recipe_num_devices}"
  return "; start one process per GPU of the layout, or pass --nodes N for the job's node count"


def check_visible_devices(cfg: Any, *, visible: int, processes: int = 1) -> None:
  """The recipe's device count (its nodes x GPUs per node) and parallelism product must match what the job
  sees; on CPU each node is one process."""
  want = cfg.recipe_num_devices
  where = f" to {processes} processes" if processes > 1 else ""
  nodes = max(int(cfg.nodes), 1)
  if want > 0 and want != visible:
    layout = f"{nodes} node(s), {want} devices" if str(cfg.recipe_hardware) != "cpu" else f"{want} devices"
    raise UserError(
      f"recipe lays out {layout} but {visible} are visible{where}"
      f"{_device_hint(cfg, visible=visible, processes=processes)}"
    )
  if str(cfg.recipe_hardware) == "cpu" and nodes > 1 and processes != nodes:
    raise UserError(
      f"nodes={nodes} on CPU runs one process per node, but this job has {processes} process(es); start "
      f"{nodes} (maxtext-moe launch --nproc-per-node 1 --nnodes {nodes}), or set nodes={processes}"
    )
  try:
    checks.check_layout_fits_devices(cfg, num_devices=visible)
  except ValueError as e:
    raise UserError(str(e)) from e


def check_nvlink_domains(cfg: Any, devices: list) -> None:
  """On GPU, the NVLink domains JAX reports (each device's `slice_index`: its NVL72 rack's fabric, else
  its host) must be the ones the layout expects (num_slices, from nodes), or MaxText's mesh puts ICI
  degrees across the network. A rack whose multi-node NVLink is not set up for the job (IMEX channels,
  NVIDIA's ComputeDomain on Kubernetes) shows each host as its own domain."""
  from maxtext_moe.config.nodes import gpus_per_node  # pylint: disable=import-outside-toplevel

  seen = sorted({int(getattr(d, "slice_index", 0)) for d in devices})
  want = max(int(cfg.num_slices), 1)
  if not hasattr(devices[0], "slice_index") or len(seen) == want:
    return
  per = len(devices) // max(len(seen), 1)
  why = (
    "; each host is its own domain here: on GB200/GB300 the job needs the rack's multi-node NVLink (an IMEX "
    "channel: NVIDIA's ComputeDomain on Kubernetes, docs/cluster.md)"
    if per == gpus_per_node(cfg.recipe_hardware, int(cfg.gpus_per_node)) and want < len(seen)
    else ""
  )
  raise UserError(
    f"JAX reports {len(seen)} NVLink domain(s) of about {per} GPUs but the layout wants {want} of "
    f"{len(devices) // want}{why}; check --nodes and which nodes the job got"
  )


def model_leaves(cfg: Any) -> list:
  """The run's parameter tree (`upstream.maxtext.model.param_leaves`: a trace, nothing allocated), for the
  checks below."""
  from maxtext_moe.upstream.maxtext import config, model  # pylint: disable=import-outside-toplevel

  return model.param_leaves(config.hyperparameters(cfg))


def check_layout_divides(cfg: Any, leaves: list, *, num_devices: int) -> None:
  """Every parameter splits evenly over its mesh axes (else JAX refuses the train state with a traceback
  from inside MaxText): one line naming the tensor and the nearest layout that divides."""
  from maxtext_moe.planner import divisibility  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext import config  # pylint: disable=import-outside-toplevel

  divisibility.check(config.hyperparameters(cfg), leaves, num_devices)


def check_microbatches_split(cfg: Any, *, num_devices: int) -> None:
  """Each pipeline microbatch splits over a stage's devices on the batch (else a shard_map error from inside
  MaxText's pipeline loop, once compiling has begun): `stage_checks.check_microbatch_splits` at the job's
  device count, which the config check skips where the recipe does not give it (a CPU run); and the
  exchange's chunks divide a device's tokens (`chunk_checks.check_exchange_chunks`), likewise."""
  from maxtext_moe.config.chunk_checks import check_exchange_chunks  # pylint: disable=import-outside-toplevel
  from maxtext_moe.config.stage_checks import check_microbatch_splits  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext import config  # pylint: disable=import-outside-toplevel

  try:
    check_microbatch_splits(config.hyperparameters(cfg), num_devices)
    check_exchange_chunks(config.hyperparameters(cfg), num_devices)
  except ValueError as e:
    raise UserError(str(e)) from None


def check_checkpoint_matches(cfg: Any, leaves: list) -> None:
  """The checkpoint the run loads holds this model's parameters, read from its metadata before MaxText's
  restore (checkpoint/model_check.py): one line naming the first tensor that differs."""
  from maxtext_moe.checkpoint import model_check  # pylint: disable=import-outside-toplevel

  model_check.check(cfg, model_check.ModelTree.as_run(cfg, leaves))


def check_platform(cfg: Any, *, platform: str) -> None:
  """Settings that need an XLA backend feature this platform lacks."""
  if cfg.offload is not None:
    import jax  # pylint: disable=import-outside-toplevel

    try:
      jax.devices()[0].memory("pinned_host")
    except Exception:  # pylint: disable=broad-except  # jax raises several types for a missing memory kind
      raise UserError(
        f"offload={cfg.offload} needs pinned host memory, which {platform} devices here lack; set offload=none"
      ) from None
  if platform == "cpu" and str(cfg.offload) in ("activations", "all"):
    print(
      f"maxtext-moe: note: offload={cfg.offload} leaves activations in memory on CPU (JAX lowers host transfers "
      "inside a step only for GPU and TPU); the optimizer and parameter parts do apply",
      file=sys.stderr,
    )
  if platform == "cpu" and str(cfg.attention) not in ("autoselected", "dot_product"):
    raise UserError(  # MaxText's other kernels raise at trace time on CPU (NotImplementedError, found by fuzzing)
      f"attention={cfg.attention} needs a GPU or TPU; use attention=dot_product (or autoselected) on CPU"
    )
  if platform == "cpu" and str(cfg.moe_dispatch) == "ragged_all_to_all":
    raise UserError(
      "moe_dispatch=ragged_all_to_all needs a GPU or TPU (XLA:CPU has no ragged-all-to-all); "
      "use moe_dispatch=all_to_all or auto on CPU"
    )


def check_moe_path(cfg: Any) -> None:
  """The GPU fast path's requirements (TE, one GPU per process, the layout TE EP serves, FP8 support),
  checked once the backend is up and before anything is compiled: one line each, with the fix."""
  from maxtext_moe.moe import mesh_axes, settings  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext import moe_layer  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.te import calls as te  # pylint: disable=import-outside-toplevel

  if str(cfg.moe_impl) == "maxtext" and getattr(cfg, "te_moe_block", False) and not te.status().available:
    raise UserError(f"te_moe_block=true needs Transformer Engine, which does not import here: {te.status().reason}")
  if str(cfg.attention) == "cudnn_flash_te" and not te.status().available:
    raise UserError(
      f"attention=cudnn_flash_te needs Transformer Engine, which does not import here ({te.status().reason}); "
      "run in the image, or set attention=dot_product"
    )
  quantization = quantization_name(cfg)
  if quantization.startswith("te_") and not te.status().available:
    raise UserError(
      f"quantization={quantization} is Transformer Engine's dense GEMM, which does not import here "
      f"({te.status().reason}); run in the image, or use quantization=fp8 (XLA's own FP8 GEMMs), "
      "or quantization= (empty) for none"
    )
  if str(cfg.moe_impl) != "dropless" or cfg.num_experts <= 1:
    return
  dispatch, gemm = moe_layer.resolved_kinds(cfg)
  try:
    if dispatch == settings.DispatchKind.TE_EP:
      reasons = te.ep_unready_reasons()
      if reasons:
        raise UserError(
          f"moe_dispatch=te_ep cannot run here: {'; '.join(reasons)} (maxtext-moe doctor says more); "
          "launch one process per GPU, or use moe_dispatch=auto"
        )
      mesh_axes.check_te_ep_layout(moe_layer.mesh_axis_sizes(cfg), num_experts=cfg.num_experts)
    if gemm == settings.GemmBackend.TE and (jax_platform() != "gpu" or not te.status().available):
      raise UserError(
        f"moe_gemm_backend=te needs Transformer Engine on a GPU ({te.status().reason or 'not a GPU'}); "
        "use moe_gemm_backend=auto"
      )
    settings.check_quantization(cfg.moe_gemm_quantization, gemm, dispatch)
    nodes = expert_nodes(cfg)
    capacity = float(cfg.moe_capacity_factor)  # auto's choice checked as if named (a te_ep below 1, say)
    settings.check_dispatch(dispatch, ep=expert_parallelism(cfg), capacity_factor=capacity, nodes=nodes)
    settings.check_buffers(dispatch, cfg.moe_buffers, capacity_factor=float(cfg.moe_capacity_factor), nodes=nodes)
    if note := settings.cross_node_note(cfg.moe_dispatch, dispatch, ep=expert_parallelism(cfg), nodes=nodes):
      if jax_platform() == "gpu":  # where TE's NCCL EP would have run
        print(f"maxtext-moe: note: {note}", file=sys.stderr)
    if str(cfg.moe_gemm_quantization) != "none":
      supported, why = te.scaling_mode_supported(str(cfg.moe_gemm_quantization))
      if not supported:
        raise UserError(f"moe_gemm_quantization={cfg.moe_gemm_quantization} is not supported on this GPU: {why}")
  except ValueError as e:
    raise UserError(str(e)) from e


def jax_platform() -> str:
  import jax  # pylint: disable=import-outside-toplevel

  return jax.default_backend()


def check_inputs(cfg: Any) -> None:
  """What the run reads and writes, before its directory is created: the output directory, the batch,
  the data files and the tokenizer; the checkpoint it loads read at its own scan axis."""
  from maxtext_moe.checkpoint.model_check import check_scan_axis  # pylint: disable=import-outside-toplevel
  from maxtext_moe.config.paths import data_files, unwritable_reason  # pylint: disable=import-outside-toplevel

  check_scan_axis(cfg)
  why = unwritable_reason(cfg.base_output_directory)
  if why:
    raise UserError(f"base_output_directory={cfg.base_output_directory}: {why}; choose a directory you can write")
  if int(cfg.global_batch_size_to_train_on) < 1:
    raise UserError(
      f"per_device_batch_size={cfg.per_device_batch_size} gives a global batch of "
      f"{cfg.global_batch_size_to_train_on} sequences; raise it so the devices hold at least one"
    )
  dataset = str(getattr(cfg.dataset_type, "value", cfg.dataset_type))
  if dataset == "synthetic":
    return
  if dataset == "grain" and not data_files(cfg.grain_train_files):
    raise UserError(f"grain_train_files={cfg.grain_train_files!r} matches no file; check the path or pattern")
  tokenizer = str(cfg.tokenizer_path or "")
  kind = str(getattr(cfg.tokenizer_type, "value", cfg.tokenizer_type))
  if tokenizer and "://" not in tokenizer and kind in ("sentencepiece", "tiktoken") and not Path(tokenizer).exists():
    raise UserError(f"tokenizer_path={tokenizer} does not exist (tokenizer_type={kind}); point it at the model file")
  local = tokenizer.startswith(("/", ".", "~"))  # not a Hugging Face Hub name (org/model)
  if kind == "huggingface" and local and not Path(tokenizer).expanduser().is_dir():
    raise UserError(
      f"tokenizer_path={tokenizer} is not a directory (tokenizer_type=huggingface); point it at the "
      "Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json)"
    )
  if kind == "huggingface" and local:
    check_bos(cfg)


def _bos_token(path: str) -> str | None:
  """The BOS token of the Hugging Face tokenizer at `path` (None: it has none); one line if none loads."""
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel

  from maxtext_moe.data.text import tokenizer_size  # pylint: disable=import-outside-toplevel

  tokenizer_size(path)  # one line for a directory no tokenizer loads from
  return AutoTokenizer.from_pretrained(path).bos_token


def check_bos(cfg: Any) -> None:
  """add_bos=true (MaxText's default) with a Hugging Face tokenizer that has no BOS token (Qwen3's has none).
  MaxText's tokenizer then adds nothing, which is what such a model was trained with: a pretraining run
  goes on and says so at start, in one line. Packing by concat_then_split would put the missing BOS first
  in every row (grain raises from inside the pipeline): refused, with the fix. SFT runs are silent: the
  chat template writes whatever BOS the model uses, and add_bos does not apply to it."""
  if not cfg.add_bos or _bos_token(str(cfg.tokenizer_path)) is not None:
    return
  where = f"the tokenizer at {cfg.tokenizer_path} has no BOS token (Qwen3's has none)"
  if str(cfg.grain_packing_type) == "concat_then_split":
    raise UserError(
      f"add_bos=true with grain_packing_type=concat_then_split starts every packed row with the BOS token, and "
      f"{where}; set add_bos=false"
    )
  import jax  # pylint: disable=import-outside-toplevel

  if not cfg.use_sft and jax.process_index() == 0:
    ends = "each ended by its EOS token (add_eos=true)" if cfg.add_eos else "with nothing between them (add_eos=false)"
    print(
      f"maxtext-moe: note: {where}, so add_bos=true adds nothing: documents are packed without one, {ends}; "
      "set add_bos=false to say so",
      file=sys.stderr,
    )


def absolute_checkpoint_paths(cfg: Any) -> Any:
  """`cfg` with a relative load_parameters_path / load_full_state_path made absolute: Orbax's OCDBT spec
  refuses a relative path, with a traceback from deep inside the restore."""
  update = {}
  for key in ("load_parameters_path", "load_full_state_path"):
    value = str(getattr(cfg, key) or "")
    if value and "://" not in value and not Path(value).is_absolute():
      update[key] = str(Path(value).absolute())
  return cfg.model_copy(update=update) if update else cfg
