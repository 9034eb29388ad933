"""Memory planner: will a recipe fit, what does it cost, and what is the cheapest change that makes it fit.

`plan(recipe, overrides, gpus=..., gpu_mem_gib=...)` estimates one device's memory at the training step's
peak from the resolved config alone (nothing is compiled or allocated, so it answers for 1,024 GPUs on a
laptop), and MaxText's own FLOPs count gives FLOPs per token and TFLOP/s per GPU at a stated MFU.

The estimate (bytes per device; T = tokens per device, V = vocab, D = model dim, F = expert hidden dim):

  state        parameters (weight_dtype) + Adam's two moments (mu_dtype), each leaf divided by the mesh axes
               its logical names resolve to (MaxText's logical_axis_rules, flax's resolution), minus what
               offload puts on the host
  grads        one grad_dtype copy of the sharded parameters
  scan copy    with param_scan_axis != 0 the stacked layer weights are re-laid out layer-major once for the
               scanned backward (seen in XLA's buffer assignment; MaxText's param_scan_axis=0 avoids it)
  saved        what the remat policy keeps per layer: the layer input (T x D) under `full`; on the host when
               the offload preset offloads it
  peak         the larger of two phases:
                 loss     4 float32 T x V logits-sized buffers (logits, softmax, their gradient, the one-hot
                          scatter), + one T x V copy in a narrower compute dtype
                 layer    the backward of one MoE layer while 2 of those logits buffers are still live:
                            MoE rows R (see below) x (D x (4 + 4 x dtype bytes) + F x 6 x dtype bytes)
                            + attention: 4 x B x H x L x L scores for dot-product attention; for flash,
                              4 x T x H x (qk + v head dims)
  MoE rows R   what our dispatchers allocate, dropless sizes being worst cases:
                 local  T x K;  all_to_all  EP x cap x K (cap = T dropless);  ragged_all_to_all  T x EP x K

The copy counts (4 logits buffers, 2 live in the layer phase, the MoE row buffers) were read off XLA's
buffer assignment for the tiny and 16B-proxy train steps (`--xla_dump_hlo_as_text`, the peak's live set);
`maxtext-moe bench plan` checks the whole estimate against XLA's compiled `memory_analysis()` on CPU.
"""

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import flax.linen as nn
import numpy as np

from maxtext_moe.config.keys import Hardware
from maxtext_moe.config.offload import OffloadPreset
from maxtext_moe.errors import UserError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """Per-GPU figures from the vendors' data sheets: HBM, host memory per GPU, dense bf16 peak."""

  hbm_gib: float
  host_gib: float
  peak_bf16_tflops: float


# Host memory per GPU: DGX H100/H200 2 TB / 8, DGX B200 4 TB / 8, GB200/GB300 NVL72 one 480 GB Grace per 2 GPUs.
DEVICES: dict[Hardware, DeviceSpec] = {
  Hardware.H100: DeviceSpec(80, 256, 989),
  Hardware.H200: DeviceSpec(141, 256, 989),
  Hardware.B200: DeviceSpec(180, 512, 2250),
  Hardware.GB200: DeviceSpec(186, 240, 2500),
  Hardware.GB300: DeviceSpec(288, 240, 2500),
}

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_bytes(dtype: Any) -> int:
  name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
  if name not in _DTYPE_BYTES:
    raise UserError(f"the planner does not know dtype '{name}'; use one of {', '.join(_DTYPE_BYTES)}")
  return _DTYPE_BYTES[name]


def mesh_sizes(cfg: Any, num_devices: int) -> dict[str, int]:
  """{mesh axis: size} from the config's ICI and DCN degrees, with a -1 axis filled as MaxText does."""
  slices = max(int(getattr(cfg, "num_slices", 1) or 1), 1)

  def fill(degrees: list[int], total: int) -> list[int]:
    degrees = [int(d) for d in degrees]
    if -1 in degrees:
      known = math.prod(d for d in degrees if d != -1)
      degrees[degrees.index(-1)] = max(total // known, 1)
    return degrees

  ici = fill(list(cfg.ici_parallelism), num_devices // slices)
  dcn = fill(list(cfg.dcn_parallelism), slices)
  return {axis: i * d for axis, i, d in zip(cfg.mesh_axes, ici, dcn, strict=True)}


def _mesh_axes(names: tuple, rules: list) -> list[tuple[str, ...]]:
  """Mesh axes each dim of an array with logical `names` is sharded over, by flax's rule resolution (what
  MaxText's shardings use): rules in priority order, each mesh axis used at most once per array."""
  return [
    () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    for axes in nn.logical_to_mesh_axes(names, rules)
  ]


def shard_elements(shape: tuple, names: tuple, rules: list, sizes: dict[str, int]) -> int:
  """Elements of one device's shard of a parameter: each dim divided (rounded up, as XLA pads uneven
  shards) by the sizes of the mesh axes its logical name resolves to."""
  total = 1
  for dim, axes in zip(shape, _mesh_axes(names, rules), strict=True):
    total *= -(-dim // math.prod(sizes.get(a, 1) for a in axes))
  return total


@dataclasses.dataclass
class Estimate:
  """One device's memory, in bytes, and where it goes."""

  params: int
  optimizer: int
  grads: int
  scan_copy: int
  saved_activations: int
  logits_phase: int
  layer_phase: int
  moe_rows: int
  moe_dispatch: int
  attention: int
  host: int
  device_total: int
  hbm: int | None
  host_capacity: int | None
  tflops_per_step: float
  tokens_per_step: int
  overrides: list[str] = dataclasses.field(default_factory=list)

  @property
  def fits(self) -> bool:
    device_ok = self.hbm is None or self.device_total <= self.hbm
    host_ok = self.host_capacity is None or self.host <= self.host_capacity
    return device_ok and host_ok


def _saved_per_layer(cfg: Any, tokens: int, d_bytes: int, rows: int) -> tuple[int, int]:
  """(device, host) bytes the remat policy keeps per MoE layer for the backward."""
  emb, ffn = int(cfg.emb_dim), int(cfg.moe_mlp_dim)
  sizes = {
    "decoder_layer_input": tokens * emb,
    "out_proj": tokens * emb,
    "mlpwo": tokens * emb,
    "moe_mlpwi_0": rows * ffn,
    "moe_mlpwi_1": rows * ffn,
    "moe_mlpwo": rows * emb,
  }
  policy = str(cfg.remat_policy)
  if policy != "custom":  # full, and policies not modelled: the layer input, which every policy keeps
    return tokens * emb * d_bytes, 0
  device = host = 0
  for name, elems in sizes.items():
    where = str(getattr(cfg, name, "remat"))
    if name == "decoder_layer_input" and where == "remat":
      where = "device"  # the scan carry is kept regardless
    if where == "device":
      device += elems * d_bytes
    elif where == "offload":
      host += elems * d_bytes
  return device, host


def moe_rows(cfg: Any, tokens: int, ep: int, dispatch: str) -> int:
  """Rows of the routed-expert buffers on one device (see the module docstring)."""
  k = int(cfg.num_experts_per_tok)
  if dispatch == "local":
    return tokens * k
  if dispatch == "all_to_all":
    cf = float(cfg.moe_capacity_factor)
    cap = tokens if cf <= 0 else max(1, min(tokens, math.ceil(cf * tokens * k / ep)))
    return ep * cap * k
  return tokens * ep * k  # ragged_all_to_all


def estimate(
  cfg: Any,
  leaves: list,
  *,
  num_devices: int,
  dispatch: str,
  hbm_gib: float | None,
  host_gib: float | None,
  tflops: float,
) -> Estimate:
  """The per-device estimate for a resolved config and its parameter leaves (see the module docstring)."""
  sizes = mesh_sizes(cfg, num_devices)
  rules = [(name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in cfg.logical_axis_rules]
  w_b, d_b = dtype_bytes(cfg.weight_dtype), dtype_bytes(cfg.dtype)
  g_b = dtype_bytes(cfg.grad_dtype)
  mu_b = dtype_bytes(cfg.mu_dtype or cfg.weight_dtype)
  param_elems = scanned_elems = 0
  for path, shape, names in leaves:
    if path[0] != "params":
      continue
    n = shard_elements(shape, names, rules, sizes)
    param_elems += n
    if any(name in ("layers", "dense_layers", "moe_layers") for name in names):
      scanned_elems += n
  opt_slots = 2 if str(cfg.opt_type).lower().endswith(("adamw", "adam_pax")) else 0
  params, optimizer = param_elems * w_b, param_elems * mu_b * opt_slots
  grads = param_elems * g_b
  scan_copy = scanned_elems * w_b if int(cfg.param_scan_axis) != 0 and cfg.scan_layers else 0

  batch_shards = math.prod(sizes.get(a, 1) for a in _mesh_axes(("activation_batch",), rules)[0])
  tokens = int(cfg.per_device_batch_size * num_devices) * int(cfg.max_target_length) // max(batch_shards, 1)
  seq = int(cfg.max_target_length)
  ep = sizes.get("expert", 1)
  rows = moe_rows(cfg, tokens, ep, dispatch) if int(cfg.num_experts) > 1 else 0
  emb, ffn, vocab = int(cfg.emb_dim), int(cfg.moe_mlp_dim), int(cfg.vocab_size)
  moe_dispatch = rows * (emb * (4 + 4 * d_b) + ffn * 6 * d_b)
  dot_product = str(cfg.attention) == "dot_product" or (
    str(cfg.attention) == "autoselected" and str(cfg.hardware) == "cpu"
  )
  heads = int(cfg.num_query_heads)
  batch = max(tokens // seq, 1)
  qk_dim = int(getattr(cfg, "qk_nope_head_dim", 0) or 0) + int(getattr(cfg, "qk_rope_head_dim", 0) or 0)
  qk_dim = qk_dim if str(cfg.attention_type) == "mla" else int(cfg.head_dim)
  v_dim = int(getattr(cfg, "v_head_dim", 0) or 0) if str(cfg.attention_type) == "mla" else int(cfg.head_dim)
  if dot_product:  # the B x H x L x L scores, 4 copies (scores, softmax and their gradients)
    attention = 4 * batch * heads * seq * seq * d_b
  else:  # flash: q, k, v, out and their gradients, no L x L buffer
    attention = 4 * tokens * heads * (qk_dim + v_dim) * d_b
  logits = tokens * vocab * 4
  logits_phase = 4 * logits + (tokens * vocab * d_b if d_b < 4 else 0)
  layer_phase = 2 * logits + moe_dispatch + attention

  layers = int(cfg.num_decoder_layers) + int(getattr(cfg, "mtp_num_layers", 0) or 0)
  saved_dev, saved_host = _saved_per_layer(cfg, tokens, d_b, rows)
  host = saved_host * layers
  if cfg.optimizer_memory_host_offload:
    host += optimizer
    optimizer = 0
  if cfg.parameter_memory_host_offload:
    host += params
    params = 0
  saved = saved_dev * layers
  device_total = params + optimizer + grads + scan_copy + saved + max(logits_phase, layer_phase)
  return Estimate(
    params=params,
    optimizer=optimizer,
    grads=grads,
    scan_copy=scan_copy,
    saved_activations=saved,
    logits_phase=logits_phase,
    layer_phase=layer_phase,
    moe_rows=rows,
    moe_dispatch=moe_dispatch,
    attention=attention,
    host=host,
    device_total=device_total,
    hbm=None if hbm_gib is None else int(hbm_gib * GIB),
    host_capacity=None if host_gib is None else int(host_gib * GIB),
    tflops_per_step=tflops,
    tokens_per_step=tokens,
  )


def _gib(n: int | None) -> str:
  return "-" if n is None else f"{n / GIB:,.1f}"


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass
class Plan:
  recipe: str
  hardware: Hardware
  num_devices: int
  dispatch: str
  layout: dict[str, int]
  mfu: float
  base: Estimate
  fix: Estimate | None
  fix_kind: str | None
  tried: int

  @property
  def peak_tflops(self) -> float | None:
    spec = DEVICES.get(self.hardware)
    return spec.peak_bf16_tflops if spec else None

  def table(self) -> str:
    """A readable report: layout, memory per device by component, verdict, fix, throughput."""
    e = self.base
    layout = " x ".join(f"{a}={n}" for a, n in self.layout.items() if n > 1) or "1 device"
    lines = [
      f"{self.recipe}: {self.num_devices} x {self.hardware.value}, {layout}, MoE dispatch {self.dispatch}",
      f"  tokens per device per step: {e.tokens_per_step:,}; MoE rows per device: {e.moe_rows:,}",
      "",
      f"  {'per device':<44}{'GiB':>10}",
      f"  {'parameters':<44}{_gib(e.params):>10}",
      f"  {'optimizer state (Adam mu, nu)':<44}{_gib(e.optimizer):>10}",
      f"  {'gradients':<44}{_gib(e.grads):>10}",
      f"  {'scanned weights re-laid out for backward':<44}{_gib(e.scan_copy):>10}",
      f"  {'saved activations (remat policy)':<44}{_gib(e.saved_activations):>10}",
      f"  {'loss phase: logits and their gradient':<44}{_gib(e.logits_phase):>10}",
      f"  {'layer phase: MoE dispatch buffers':<44}{_gib(e.moe_dispatch):>10}",
      f"  {'layer phase: attention':<44}{_gib(e.attention):>10}",
      f"  {'total on device (peak)':<44}{_gib(e.device_total):>10}",
      f"  {'usable HBM':<44}{_gib(e.hbm):>10}",
      f"  {'host memory (offloaded)':<44}{_gib(e.host):>10}",
      f"  {'host memory per GPU':<44}{_gib(e.host_capacity):>10}",
      "",
    ]
    flops_token = e.tflops_per_step * 1e12 / max(e.tokens_per_step, 1)
    lines.append(f"  training FLOPs per token: {flops_token / 1e9:,.2f} GFLOP (MaxText's count, 6N + attention)")
    if self.peak_tflops:
      achieved = self.mfu * self.peak_tflops
      step = e.tflops_per_step / achieved
      lines.append(
        f"  at {self.mfu:.0%} MFU of {self.peak_tflops:,.0f} dense bf16 TFLOP/s: {achieved:,.0f} TFLOP/s per GPU, "
        f"{step:.2f} s per step, {e.tokens_per_step / step:,.0f} tokens/s per GPU"
      )
    lines.append("")
    if e.hbm is None:
      lines.append("  verdict: no device memory limit on this hardware (pass --gpu-mem GiB to check one)")
    elif e.fits:
      lines.append(f"  verdict: FITS ({_gib(e.hbm - e.device_total)} GiB to spare on device)")
    else:
      where = "device" if e.device_total > (e.hbm or 0) else "host"
      lines.append(f"  verdict: DOES NOT FIT ({where} memory)")
      if self.fix is not None:
        lines.append(
          f"  cheapest fix ({self.fix_kind}): {' '.join(self.fix.overrides)} -> "
          f"{_gib(self.fix.device_total)} GiB on device, {_gib(self.fix.host)} GiB on host"
        )
      else:
        lines.append(f"  no offload preset, EP/FSDP split or smaller micro-batch makes it fit ({self.tried} tried)")
    return "\n".join(lines)

  def as_dict(self) -> dict:
    return {
      "recipe": self.recipe,
      "num_devices": self.num_devices,
      "dispatch": self.dispatch,
      "layout": self.layout,
      "fits": self.base.fits,
      "estimate": dataclasses.asdict(self.base),
      "fix": None if self.fix is None else {"kind": self.fix_kind, "overrides": self.fix.overrides},
    }


def _candidates(cfg: Any) -> Iterable[tuple[str, list[str]]]:
  """Changes in the order we consider them cheapest: offload presets, then EP/FSDP splits of the same
  devices (each axis kept within its ICI/DCN side), then smaller micro-batches."""
  current = [p.value for p in OffloadPreset]
  start = current.index(cfg.offload.value) + 1 if cfg.offload else 0
  for preset in current[start:]:
    yield "offload preset", [f"offload={preset}"]
  ep, fsdp = int(cfg.ici_expert_parallelism), int(cfg.ici_fsdp_parallelism)
  if ep > 0 and fsdp > 0:
    ici = ep * fsdp
    # Nearest EP first: the smallest change to the recipe's communication pattern.
    for new_ep in sorted(_divisors(ici), key=lambda d: (abs(math.log(d / ep)), -d)):
      if new_ep != ep and int(cfg.num_experts) % new_ep == 0:
        yield "EP/FSDP split", [f"ici_expert_parallelism={new_ep}", f"ici_fsdp_parallelism={ici // new_ep}"]
  pdbs = float(cfg.per_device_batch_size)
  while pdbs > 1:
    pdbs = pdbs / 2
    if pdbs == int(pdbs):
      yield "smaller micro-batch", [f"per_device_batch_size={int(pdbs)}"]


def plan(
  recipe: str, overrides: list[str], *, gpus: int | None = None, gpu_mem_gib: float | None = None, mfu: float = 0.4
) -> Plan:
  """Estimates `recipe` + overrides and, when it does not fit, searches for the cheapest change that does."""
  from maxtext_moe import maxtext_adapter  # pylint: disable=import-outside-toplevel
  from maxtext_moe.config.recipes import recipe_path  # pylint: disable=import-outside-toplevel
  from maxtext_moe.launch import flags  # pylint: disable=import-outside-toplevel
  from maxtext_moe.moe.block import resolve_dispatch  # pylint: disable=import-outside-toplevel

  path = recipe_path(recipe)
  # A fine-tuning recipe's weights do not change its memory: plan it without them.
  base_overrides = ["finetune=false", *overrides] + ([f"recipe_num_devices={gpus}"] if gpus else [])
  cfg = maxtext_adapter.resolved(path, base_overrides)
  hardware = Hardware(cfg.recipe_hardware)
  n = int(cfg.recipe_num_devices)
  if n <= 0:
    import jax  # pylint: disable=import-outside-toplevel

    n = jax.device_count()
  spec = DEVICES.get(hardware)
  env = flags.for_config(cfg).env
  mem_fraction = float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75 if spec else 1.0))
  hbm = gpu_mem_gib if gpu_mem_gib is not None else (spec.hbm_gib * mem_fraction if spec else None)
  host = spec.host_gib if spec else None
  # The parameter tree's shapes do not depend on the layout: trace it once, on one device.
  leaves = maxtext_adapter.param_leaves(
    maxtext_adapter.resolved(path, [*base_overrides, *maxtext_adapter.ONE_DEVICE_OVERRIDES])
  )
  platform = "cpu" if str(cfg.hardware) == "cpu" else "gpu"

  def one(c: Any, extra: list[str]) -> tuple[Estimate, str]:
    sizes = mesh_sizes(c, n)
    kind = resolve_dispatch(
      c.moe_dispatch, ep=sizes.get("expert", 1), capacity_factor=float(c.moe_capacity_factor), platform=platform
    ).value
    total, _, _ = maxtext_adapter.train_tflops_per_device(c)
    est = estimate(c, leaves, num_devices=n, dispatch=kind, hbm_gib=hbm, host_gib=host, tflops=total)
    est.overrides = extra
    return est, kind

  base, dispatch = one(cfg, [])
  fix, fix_kind, tried = None, None, 0
  if not base.fits:
    for kind, extra in _candidates(cfg):
      tried += 1
      try:
        cand_cfg = maxtext_adapter.resolved(path, base_overrides + extra)
      except UserError:
        continue  # an invalid layout for this model (e.g. experts not divisible)
      cand, _ = one(cand_cfg, extra)
      if cand.fits:
        fix, fix_kind = cand, kind
        break
  layout = {a: s for a, s in mesh_sizes(cfg, n).items() if s > 1}
  return Plan(recipe, hardware, n, dispatch, layout, mfu, base, fix, fix_kind, tried)
