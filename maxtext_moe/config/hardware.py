"""The hardware table: one row per GPU model, read by the planner, `k8s`, the flag profiles, `compile` and
the tests. Adding a GPU model is one row here and a profile in configs/flags/profiles.yml
(docs/contributing.md).

Where each figure comes from:
- HBM, SM count, clock, L2 and memory bandwidth: what the CUDA driver reports for the device
  (`cudaGetDeviceProperties`), as recorded in XLA's GPU target specs (openxla/xla,
  xla/backends/gpu/target_config/specs/*.txtpb), which match NVIDIA's data sheets (H100 80 GB / 3.35 TB/s,
  H200 141 GB / 4.8 TB/s, B200 180 GB / 8 TB/s, GB200 186 GB / 8 TB/s, B300 and GB300 288 GB / 8 TB/s;
  b300.txtpb: 158 SMs at 1.965 GHz, compute capability 10.3). XLA has no GH200 spec: its GPU is the H100
  SXM's die (132 SMs, 1.98 GHz, 50 MiB of L2, compute capability 9.0) with 96 GB of HBM3 at 4 TB/s
  (NVIDIA's GH200 data sheet), and its device memory is what nvidia-smi reports for "NVIDIA GH200 480GB",
  97,871 MiB (logs of Lambda's and CoreWeave's GH200 machines).
- Dense tensor-core peaks: NVIDIA's data sheets, which print them with 2:4 sparsity; these are half of
  those. H100/H200 SXM: bf16 989, fp8 1,979 TFLOP/s. DGX B200: bf16 2,250, fp8 and mxfp8 4,500. GB200 and
  GB300 NVL72 (per GPU, the rack's figure / 72): bf16 2,500, fp8 and mxfp8 5,000. HGX/DGX B300 (NVIDIA's
  HGX platform page, nvidia.com/en-us/data-center/hgx, per board of 8): FP16/BF16 36 PFLOPS and FP8/FP6
  72 PFLOPS with sparsity, so bf16 2,250 and fp8 and mxfp8 4,500 per GPU, B200's; FP4 144 PFLOPS sparse
  and 108 dense, 13,500 per GPU (B200: 72 dense, 9,000); FP64 10 TFLOPS per board (B200: 296), the
  silicon Blackwell Ultra gave up for NVFP4 (NVIDIA's "Inside NVIDIA Blackwell Ultra" blog, 2025-08).
  The `nvfp4` peaks (dense): B200 9,000, GB200 10,000 (720 PFLOPS / 72), B300 13,500, GB300 15,000
  (1,080 / 72); no GEMM class is timed in NVFP4 yet (config/quantization.py refuses te_nvfp4). GH200: the
  H100 SXM's (its data sheet: FP16/BF16 990, FP8 1,979 dense).
- NVLink: 900 GB/s per GPU (NVLink 4, H100/H200) and 1.8 TB/s (NVLink 5, Blackwell, B300 included), both
  counted in both directions; the table keeps one direction. NVLink domain: the 8 GPUs of an HGX board, or
  the 72 of an NVL72 rack. GH200 nodes of four (HPE Cray EX254n and Eviden BullSequana XH3000 blades: CSCS
  Alps, JUPITER, Isambard-AI) join their GPUs all to all over NVLink 4, 6 of each GPU's 18 links to each
  peer: 450 GB/s per GPU and direction in all, 150 to any one peer; no switch.
- Network: one ConnectX-7 400 Gb/s NIC per GPU (DGX H100/H200/B200, GB200 NVL72), ConnectX-8 800 Gb/s per
  GPU (HGX B300: 1.6 TB/s per board of 8, both directions; GB300 NVL72), one direction. GH200 nodes of four:
  one 200 Gb/s adapter per GPU (Slingshot-11 on Alps and Isambard-AI, InfiniBand NDR200 on JUPITER).
- Host memory per GPU: DGX H100/H200 2 TB / 8 GPUs; DGX B200 and DGX B300 2 TB / 8; NVL72: one Grace CPU
  with 480 GB of LPDDR5X per 2 GPUs; GH200 nodes of four: 120 GB of LPDDR5X per Grace and its one GPU (the
  smallest of those systems' 120-128 GB; single-superchip machines carry up to 480).
- Host link (`host_link`, the step-time model's offload copies): PCIe 5 on HGX boards; NVLink-C2C on Grace
  systems, 900 GB/s both directions per Grace, shared by 2 GPUs on NVL72 and held by one on GH200.
"""

from dataclasses import dataclass, field
from enum import StrEnum

GB = 10**9


@dataclass(frozen=True)
class GpuModel:
  """One GPU model as a recipe's `recipe_hardware` names it."""

  product: str  # the device name the driver reports
  hbm_bytes: int  # device memory the driver reports
  host_gb: float  # host memory per GPU
  peak_tflops: dict[str, float]  # dense tensor-core peak per number format: bf16, fp8, mxfp8
  gpus_per_node: int  # GPUs one Kubernetes pod / SLURM node drives
  nvlink_domain: int  # GPUs that reach each other over NVLink
  nvlink_gbs: float  # NVLink bandwidth per GPU, one direction, GB/s
  network_gbs: float  # scale-out network bandwidth per GPU, one direction, GB/s
  flag_profile: str  # its profile in configs/flags/profiles.yml
  compute_capability: tuple[int, int]
  sm_count: int
  clock_ghz: float
  l2_bytes: int
  hbm_bandwidth: float  # bytes/s
  host_link: str = "pcie5"  # steptime.constants.HOST_LINK_GBS: pcie5, c2c (a Grace per 2 GPUs), c2c_one_gpu
  limits: dict[str, int] = field(default_factory=dict)  # per-SM limits that differ from `SM_LIMITS`

  @property
  def hbm_gib(self) -> float:
    return self.hbm_bytes / 2**30


# Per-SM and per-block limits of every SM 9.x and 10.x GPU (CUDA C++ Programming Guide, "Compute
# Capabilities": 1024 threads per block, 2048 per SM, 64K registers, 227 KiB of shared memory per block
# on opt-in, 228 KiB per SM, 128 FP32 units per SM).
SM_LIMITS = {
  "threads_per_block_limit": 1024,
  "threads_per_warp": 32,
  "shared_memory_per_block": 48 * 1024,
  "shared_memory_per_block_optin": 227 * 1024,
  "shared_memory_per_core": 228 * 1024,
  "threads_per_core_limit": 2048,
  "fpus_per_core": 128,
  "registers_per_core_limit": 65536,
  "registers_per_block_limit": 65536,
  "block_dim_limit_x": 2**31 - 1,
  "block_dim_limit_y": 65535,
  "block_dim_limit_z": 65535,
}

_HOPPER = {"bf16": 989.0, "fp8": 1979.0}
_BLACKWELL_HGX = {"bf16": 2250.0, "fp8": 4500.0, "mxfp8": 4500.0, "nvfp4": 9000.0}
_BLACKWELL_NVL72 = {"bf16": 2500.0, "fp8": 5000.0, "mxfp8": 5000.0, "nvfp4": 10000.0}
_BLACKWELL_ULTRA_HGX = {**_BLACKWELL_HGX, "nvfp4": 13500.0}
_BLACKWELL_ULTRA_NVL72 = {**_BLACKWELL_NVL72, "nvfp4": 15000.0}

GPUS: dict[str, GpuModel] = {
  "h100": GpuModel(
    "NVIDIA H100 80GB HBM3", 84_942_979_072, 256, _HOPPER, 8, 8, 450, 50, "h100",
    (9, 0), 132, 1.98, 50 * 2**20, 3.35232e12,
  ),
  "h200": GpuModel(
    "NVIDIA H200 141GB HBM3e", 151_397_597_184, 256, _HOPPER, 8, 8, 450, 50, "h200",
    (9, 0), 132, 1.98, 50 * 2**20, 4.8e12,
  ),
  "b200": GpuModel(
    "NVIDIA B200", 191_514_411_008, 256, _BLACKWELL_HGX, 8, 8, 900, 50, "b200",
    (10, 0), 148, 1.965, 132_644_864, 7.67232e12,
  ),
  "gh200": GpuModel(
    "NVIDIA GH200 480GB", 97_871 * 2**20, 120, _HOPPER, 4, 4, 450, 25, "gh200",
    (9, 0), 132, 1.98, 50 * 2**20, 4.0e12, "c2c_one_gpu",
  ),
  "gb200": GpuModel(
    "NVIDIA GB200", 197_897_748_480, 240, _BLACKWELL_NVL72, 4, 72, 900, 50, "gb200",
    (10, 0), 152, 2.062, 135_528_448, 7.928064e12, "c2c",
  ),
  "b300": GpuModel(
    "NVIDIA B300", 297_021_865_984, 256, _BLACKWELL_ULTRA_HGX, 8, 8, 900, 100, "b300",
    (10, 3), 158, 1.965, 135_528_448, 7.936e12,
  ),
  "gb300": GpuModel(
    "NVIDIA GB300", 297_021_079_552, 240, _BLACKWELL_ULTRA_NVL72, 4, 72, 900, 100, "gb300",
    (10, 3), 152, 2.07, 135_528_448, 7.928064e12, "c2c",
  ),
}  # fmt: skip

# What a recipe is laid out for: CPU (tests, the embedded default) or a GPU model of the table.
Hardware = StrEnum("Hardware", {"CPU": "cpu", **{name.upper(): name for name in GPUS}})

CUDA_RUNTIME = (12, 8)  # what jax-cuda12 targets; XLA:GPU reads it from the target config
# cuDNN as XLA's own target spec for the GB300 states it (xla/backends/gpu/target_config/specs/gb300.txtpb):
# JAX's cuDNN attention needs >= 9.11 on SM 10.3 and >= 9.10 for MLA's unequal head dims.
CUDNN = (9, 15)


def gpu(hardware: "Hardware | str") -> GpuModel | None:
  """The table's row for a recipe's hardware (None for CPU)."""
  return GPUS.get(str(hardware))


# XLA:GPU's scheduler (and its rematerialization) works to the module's device memory where one is set, and
# to 80% of the target description's otherwise (`GetSchedulerMemoryLimit`, gpu_hlo_schedule.cc). On a GPU
# JAX sets the module's to its allocator's limit; a compile-only device has no allocator, so XLA takes the
# description's share.
DESCRIPTION_SHARE = 0.8


def target_config(model: GpuModel, *, schedules_for: int | None = None) -> str:
  """XLA:GPU's GpuTargetConfigProto for `model`, in text form: what a compile for that GPU needs when no
  such GPU is attached (`jax.experimental.topologies.get_topology_desc(target_config=...)`). `schedules_for`:
  the device memory XLA:GPU's scheduler is to work to, as on a GPU, where JAX compiles with its allocator's
  limit (XLA_PYTHON_CLIENT_MEM_FRACTION of the memory) and the scheduler spends memory on overlap up to the
  slop factor (--xla_gpu_memory_limit_slop_factor) of it less the program's arguments
  (docs/design-facts.md): the description's memory is that over `DESCRIPTION_SHARE`. Without it, the GPU's
  own memory."""
  major, minor = model.compute_capability
  memory = model.hbm_bytes if schedules_for is None else int(schedules_for / DESCRIPTION_SHARE)
  info = {
    "core_count": model.sm_count,
    "memory_bandwidth": int(model.hbm_bandwidth),
    "l2_cache_size": model.l2_bytes,
    "device_memory_size": memory,
    **SM_LIMITS,
    **model.limits,
  }
  lines = [f"  {k}: {v}" for k, v in info.items()]
  lines += [f"  clock_rate_ghz: {model.clock_ghz}", f"  cuda_compute_capability {{ major: {major} minor: {minor} }}"]
  return "\n".join(
    [
      "gpu_device_info {",
      *lines,
      "}",
      'platform_name: "CUDA"',
      f"dnn_version_info {{ major: {CUDNN[0]} minor: {CUDNN[1]} }}",
      f"runtime_version {{ major: {CUDA_RUNTIME[0]} minor: {CUDA_RUNTIME[1]} }}",
      f'device_description_str: "{model.product}"',
    ]
  )
