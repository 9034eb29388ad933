"""`maxtext-moe doctor`: what this machine offers the MoE block, and what `auto` picks here and why.

Needs JAX alone (no maxtext), so `scripts/gpu_check.sh` records it on a bare CUDA JAX machine too.
"""

from typing import Any

from maxtext_moe.moe import collectives
from maxtext_moe.moe.settings import (
  DispatchKind,
  GemmBackend,
  Platform,
  detect_platform,
  resolve_backend,
  resolve_dispatch,
)
from maxtext_moe.upstream.te import calls as te


def _gemm_why(choice: GemmBackend, platform: Platform) -> str:
  if choice == GemmBackend.TE:
    return "Transformer Engine's grouped GEMM imports here"
  if platform.name == "gpu":
    return (
      f"Transformer Engine does not import ({te.status().reason}): tokamax's Mosaic GPU kernels (no host "
      "syncs); never ragged_dot (XLA:GPU rewrites it to a dense dot) nor tiled (a host sync per expert)"
    )
  if platform.name == "tpu":
    return "Mosaic's grouped matmul behind jax.lax.ragged_dot"
  return "the portable grouped GEMM (ragged_dot runs at about 1.5% of a dense matmul on XLA:CPU)"


def _dispatch_why(choice: DispatchKind, platform: Platform, ep_reasons: list[str]) -> str:
  if choice == DispatchKind.TE_EP:
    return "TE's NCCL EP can serve this job (deduplicated, fused dispatch/combine)"
  if platform.name == "gpu":
    return (
      f"TE's NCCL EP cannot serve this job ({'; '.join(ep_reasons)}); never ragged_all_to_all on GPU "
      "(NCCL send/recv in XLA:GPU: about 2% of NVLink)"
    )
  if choice == DispatchKind.RAGGED_ALL_TO_ALL:
    return "only real rows on the wire (dropless; with a capacity: all_to_all)"
  return "the portable collective (XLA:CPU has no ragged-all-to-all)"


def probe() -> dict[str, Any]:
  """Everything the table shows, as plain data (the --json output)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel

  platform = detect_platform()
  device = jax.local_devices()[0]
  status = te.status()
  ep_reasons = te.ep_unready_reasons()
  gemm = resolve_backend("auto", platform=platform)
  dispatch = resolve_dispatch("auto", ep=2, platform=platform)
  return {
    "platform": platform.name,
    "device_kind": str(device.device_kind),
    "compute_capability": te.dotted(te.compute_capability()) if te.compute_capability() else None,
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "process_count": jax.process_count(),
    "local_devices": jax.local_device_count(),
    "global_devices": jax.device_count(),
    "nccl": te.dotted(te.nccl_version()) if te.nccl_version() else None,
    "transformer_engine": {
      "available": status.available,
      "version": status.version,
      "reason": status.reason,
      "pinned": te.PINNED,
    },
    "te_ep": {"available": platform.te_ep, "reasons": ep_reasons if not platform.te_ep else []},
    "ragged_all_to_all": collectives.has_ragged_all_to_all(),
    "auto": {
      "gemm": gemm.value,
      "gemm_why": _gemm_why(gemm, platform),
      "dispatch_without_ep": DispatchKind.LOCAL.value,
      "dispatch_with_ep": dispatch.value,
      "dispatch_why": _dispatch_why(dispatch, platform, ep_reasons),
    },
  }


def _yes(flag: bool) -> str:
  return "yes" if flag else "no"


def _ragged_note(report: dict[str, Any]) -> str:
  if not report["ragged_all_to_all"]:
    return f"XLA:{report['platform'].upper()} does not compile it"
  return "only when asked for on GPU (moe_dispatch=ragged_all_to_all)" if report["platform"] == "gpu" else ""


def table(report: dict[str, Any]) -> str:
  """One row per fact: what it is, its value, and a note where the value needs one."""
  t, ep, auto = report["transformer_engine"], report["te_ep"], report["auto"]
  rows = [
    ("platform", report["platform"], report["device_kind"]),
    ("compute capability", report["compute_capability"] or "-", "TE EP needs 9.0+, MXFP8 10.0+"),
    ("jax / jaxlib", f"{report['jax']} / {report['jaxlib']}", ""),
    (
      "devices",
      f"{report['local_devices']} per process, {report['global_devices']} in all",
      f"{report['process_count']} process(es)",
    ),
    ("NCCL", report["nccl"] or "-", f"TE EP needs {te.dotted(te.MIN_NCCL)}+"),
    ("Transformer Engine", t["version"] if t["available"] else "no", t["reason"] or f"pinned {t['pinned']}"),
    ("TE EP (te_ep)", _yes(ep["available"]), "; ".join(ep["reasons"])),
    ("ragged_all_to_all", _yes(report["ragged_all_to_all"]), _ragged_note(report)),
    ("auto grouped GEMM", auto["gemm"], auto["gemm_why"]),
    ("auto dispatch, EP=1", auto["dispatch_without_ep"], "no expert parallelism: nothing to move"),
    ("auto dispatch, EP>1", auto["dispatch_with_ep"], auto["dispatch_why"]),
  ]
  width = max(len(r[0]) for r in rows) + 2
  value_width = max(len(str(r[1])) for r in rows) + 2
  return "\n".join(f"{name:<{width}}{value!s:<{value_width}}{note}".rstrip() for name, value, note in rows)
