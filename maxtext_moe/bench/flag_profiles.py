"""`maxtext-moe bench flags`: what each GPU flag profile changes in the compiled train step.

The same small step (the 16B proxy at its 8 GPUs: one dense and two MoE layers, 2 x 1,024 tokens per GPU)
is compiled by XLA:GPU without a GPU (`maxtext-moe compile`, a child process each) under XLA's defaults
(`flag_profile=disabled`) and under the GPU's own profile, for a Hopper (H200) and a Blackwell (B200)
target, and once more on Blackwell with conditionals and collectives captured into command buffers, the
change that would take the bounded rounds' conditionals off the host. A profile's every XLA flag is
accepted when its compile succeeds (XLA:GPU rejects an unknown flag or value).

Read from each program: async collective pairs by kind (`*-start`), the operation queues (streams) its
instructions are assigned to, its command buffers (CUDA graphs) and the conditionals inside them, the host
syncs per step, and the memory per GPU. No kernel is autotuned and nothing runs: a profile's speed is not
measured here, only what it makes XLA:GPU build. About 2 minutes per case on 2 cores.
"""

from typing import IO, Any

from maxtext_moe.bench.plan_accuracy import gpu_compile
from maxtext_moe.bench.report import emit
from maxtext_moe.errors import UserError

SMALL = ["override_model_config=true", "base_num_decoder_layers=3", "first_num_dense_layers=1", "mtp_num_layers=0"]
SMALL += ["per_device_batch_size=2", "max_target_length=1024"]
CAPTURE_CONDITIONALS = "xla_flags_extra=['--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CONDITIONAL,COLLECTIVES']"
CASES: dict[str, tuple[str, list[str]]] = {
  "h200, XLA defaults": ("h200x8/deepseek3-proxy-16b", ["flag_profile=disabled"]),
  "h200, its profile (hopper)": ("h200x8/deepseek3-proxy-16b", []),
  "b200, XLA defaults": ("b200x8/deepseek3-proxy-16b", ["flag_profile=disabled"]),
  "b200, its profile (blackwell)": ("b200x8/deepseek3-proxy-16b", []),
  "b200, blackwell + CONDITIONAL,COLLECTIVES": ("b200x8/deepseek3-proxy-16b", [CAPTURE_CONDITIONALS]),
}
# What each case keeps of `compile --json`'s report.
KEPT = ("xla_flags", "async_starts", "operation_queues", "command_buffers", "conditionals")
KEPT += ("conditionals_in_command_buffers", "host_syncs_per_step", "device_bytes", "compile_s")


def run(*, out: IO[str], as_json: bool = False, only: str | None = None) -> dict[str, Any]:
  """Compiles every case (or those whose name contains `only`), prints the table and the JSON."""
  from rich.table import Table  # pylint: disable=import-outside-toplevel

  names = [n for n in CASES if only is None or only in n]
  if not names:
    raise UserError(f"no bench flags case contains {only!r}; the cases: {', '.join(CASES)}")
  cases = {}
  for name in names:
    recipe, overrides = CASES[name]
    report = gpu_compile(recipe, [*SMALL, *overrides])
    cases[name] = {key: report[key] for key in KEPT}
  table = Table(title="What each flag profile changes in the compiled step (XLA:GPU, no GPU; nothing autotuned)")
  cols = ("case", "XLA flags", "async pairs", "op queues", "command buffers", "conditionals (in buffers)")
  for col in (*cols, "host syncs", "GiB per GPU", "compile s"):
    table.add_column(col, justify="left" if col in ("case", "async pairs") else "right")
  for name, c in cases.items():
    pairs = ", ".join(f"{k} {v}" for k, v in sorted(c["async_starts"].items())) or "none"
    table.add_row(
      name,
      str(len(c["xla_flags"])),
      pairs,
      str(c["operation_queues"]),
      str(c["command_buffers"]),
      f"{c['conditionals']} ({c['conditionals_in_command_buffers']})",
      f"{c['host_syncs_per_step']:,.0f}",
      f"{c['device_bytes'] / 2**30:.2f}",
      f"{c['compile_s']:.0f}",
    )
  result = {"cases": cases}
  emit(table, result, as_json=as_json, out=out, width=160)
  return result
