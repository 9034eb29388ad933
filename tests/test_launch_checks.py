"""What stops a cluster job before it fans out, and what plan says of it: scripts/slurm/train.sbatch's first
step under a stand-in `srun` (a layout plan refuses ends the job there, exit 2, with no task started; one
that fits gets the recipe's environment and the fan-out), `plan --check`'s line, `plan --search --write`
over an existing file only with --force, and which throughput figure of `plan --time` is the prediction."""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, run_cli
from maxtext_moe import cli

SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
SRUN = """#!/usr/bin/env bash
# stand-in srun: log the call; run a one-task step here; record the fan-out's environment instead of running it
echo "srun $*" >> "$SRUN_LOG"
one=0
while [[ $# -gt 0 && "$1" == -* ]]; do [[ "$1" == --ntasks=1 ]] && one=1; shift; done
if [[ $one == 1 ]]; then exec "$@"; fi
echo "fan-out XLA_FLAGS=${XLA_FLAGS-unset}" >> "$SRUN_LOG"
min_s="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS-unset}"
echo "fan-out JAX $min_s ${JAX_REMOVE_CUSTOM_PARTITIONING_PTR_FROM_CACHE_KEY-unset}" >> "$SRUN_LOG"
"""


def _sbatch(tmp_path, nodes: int, args: list[str], **env) -> tuple[subprocess.CompletedProcess, list[str]]:
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  (bin_dir / "srun").write_text(SRUN)
  (bin_dir / "srun").chmod(0o755)
  log = tmp_path / "srun.log"
  log.unlink(missing_ok=True)
  path = f"{bin_dir}:{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"
  job = {"SRUN_LOG": str(log), "OUT": str(tmp_path / "out"), "IMAGE": "", "PATH": path}
  job |= {"SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NAME": "j", "SLURM_JOB_ID": "1"}
  base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "FIT_CHECK")}
  r = subprocess.run(
    ["bash", str(SBATCH), *args], env=base | job | env, capture_output=True, text=True, timeout=300, check=False
  )
  return r, log.read_text().splitlines() if log.exists() else []


def test_sbatch_refuses_a_layout_plan_refuses_before_any_task_starts(tmp_path):
  r, calls = _sbatch(tmp_path, 3, ["h100x8/deepseek3-671b"])
  errors = [line for line in r.stderr.splitlines() if line.startswith("maxtext-moe: error:")]
  assert r.returncode == 2, r.stderr[-3000:]
  assert errors == [
    "maxtext-moe: error: 3 NVLink domains do not divide by the fixed DCN degrees' product 32; use --nodes 32"
  ]
  assert len(calls) == 1 and "--ntasks=1" in calls[0], "one check step, no fan-out"
  assert "Traceback" not in r.stderr


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
def test_sbatch_runs_the_check_then_fans_out_with_the_recipes_environment(tmp_path):
  r, calls = _sbatch(tmp_path, 1, ["h200x8/deepseek3-proxy-16b", "steps=5"])
  assert r.returncode == 0, r.stderr[-3000:]
  assert "h200x8/deepseek3-proxy-16b on 1 node(s), 8 GPUs, fits (" in r.stderr
  assert "a checkpoint's train state is 24.2 GB per GPU, 193 GB per node" in r.stderr
  check, train, fan_out, _ = calls
  assert "plan" in check and "--check" in check and "maxtext-moe train h200x8/deepseek3-proxy-16b" in train
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in fan_out, "the flags step's exports reach srun"


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
def test_sbatch_fit_check_0_skips_the_memory_estimate_not_the_layout(tmp_path):
  big = ["h200x8/deepseek3-proxy-16b", "offload=none", "per_device_batch_size=32"]
  r, calls = _sbatch(tmp_path, 1, big)
  assert r.returncode == 2 and "does not fit: " in r.stderr and len(calls) == 1, r.stderr[-2000:]
  r, calls = _sbatch(tmp_path, 1, big, FIT_CHECK="0")
  assert r.returncode == 0 and len(calls) == 4, r.stderr[-2000:]  # check, train, its fan-out's two lines
  r, calls = _sbatch(tmp_path, 3, ["h100x8/deepseek3-671b"], FIT_CHECK="0")
  assert r.returncode == 2 and "use --nodes 32" in r.stderr and len(calls) == 1


@pytest.mark.parametrize(
  ("recipe", "cache", "knobs"),
  [
    ("h200x8/deepseek3-proxy-16b", ["jax_cache_dir={out}/j-h200x8-deepseek3-proxy-16b/jax_cache"], "10 true"),
    ("cpu/deepseek3-tiny", [], "unset unset"),  # on CPU each process's key differs: no cache (resolution.py)
  ],
)
def test_sbatch_keeps_a_gpu_runs_compiled_step_in_the_run(tmp_path, recipe, cache, knobs):
  """JAX's persistent compilation cache under OUT/RUN (MaxText's jax_cache_dir; its own default, ~/jax_cache,
  is node-local or gone with the container) and the GPU profile's knobs in every task's environment, so a
  requeue loads the train step instead of compiling it."""
  r, calls = _sbatch(tmp_path, 1, [recipe, "steps=5"], FIT_CHECK="0")
  assert r.returncode == 0, r.stderr[-3000:]
  _, train, _, jax = calls
  out = tmp_path / "out"
  want = [
    *(c.format(out=out) for c in cache),
    "steps=5",
    f"base_output_directory={out}",
    f"run_name=j-{recipe.replace('/', '-')}",
  ]
  assert train.split(" --nodes 1 ", 1)[1].split() == want
  assert jax == f"fan-out JAX {knobs}"


def test_the_signal_lead_is_a_setting_whose_default_covers_a_671b_save_at_20_gb_per_s():
  """docs/cluster.md: the 671B recipe writes ~8.2 TB of train state; at 20 GB/s that is ~410 s."""
  (line,) = [x for x in SBATCH.read_text().splitlines() if x.startswith("#SBATCH --signal=")]
  lead = int(line.rpartition("@")[2])
  assert lead >= 8.2e12 / 20e9 + 60, line  # + a step and SLURM's 60 s resolution
  assert "SBATCH_SIGNAL" in SBATCH.read_text()


def test_plan_check_is_one_line_with_the_checkpoint_size(capfd, monkeypatch):
  monkeypatch.setattr(cli, "last_word", lambda line, verbose: print(line, file=sys.stderr))  # fd 2 kept
  assert cli.main(["plan", "h100x8/deepseek3-671b", "--check"]) == 0
  (line,) = capfd.readouterr().out.strip().splitlines()
  pattern = (
    r"maxtext-moe: h100x8/deepseek3-671b on 32 node\(s\), 256 GPUs, fits \([\d.]+ GiB of 72.8 usable per GPU\); "
    r"a checkpoint's train state is ([\d.]+) GB per GPU, (\d+) GB per node, 8.2 TB per job; "
    r"the newest 2 checkpoint\(s\) stay "
    r"\(max_num_checkpoints_to_keep=2\), ([\d.]+) TB on disk, ([\d.]+) TB while a save completes"
  )
  per_gpu, per_node, kept, saving = re.fullmatch(pattern, line).groups()
  assert float(per_gpu) * 256 / 1e3 == pytest.approx(8.2, rel=0.03), "671B x (float32 + Adam's two) = 8.1 TB"
  assert int(per_node) == pytest.approx(float(per_gpu) * 8, abs=1)
  assert (float(kept), float(saving)) == pytest.approx((2 * 8.2, 3 * 8.2), rel=0.03), "the recipe keeps 2"
  assert cli.main(["plan", "h100x8/deepseek3-671b", "--check", "offload=none"]) == 2
  (err,) = [x for x in capfd.readouterr().err.splitlines() if x.startswith("maxtext-moe: error:")]
  assert "does not fit: " in err and "cheapest fix (offload preset): offload=optimizer (" in err, err


def test_plan_check_says_what_one_checkpoint_writes_per_gpu_node_and_job():
  """Per job: every GPU's share once (8.2 TB, 671B x 12 bytes), the H200 recipe's two data-parallel
  copies of the state counted once; per GPU and per node as each holds it."""
  from maxtext_moe.cluster import fit

  written = {r: fit.check(r, []).line().split("; ")[1] for r in ("h100x8/deepseek3-671b", "h200x8/deepseek3-671b")}
  assert written == {
    "h100x8/deepseek3-671b": "a checkpoint's train state is 32.1 GB per GPU, 257 GB per node, 8.2 TB per job",
    "h200x8/deepseek3-671b": "a checkpoint's train state is 64.0 GB per GPU, 512 GB per node, 8.2 TB per job",
  }


def test_plan_time_says_which_throughput_is_the_prediction(capfd):
  assert cli.main(["plan", "h200x8/deepseek3-proxy-16b"]) == 0
  plain = capfd.readouterr().out
  assert "  at an assumed 40% MFU (--mfu; not a prediction: plan --time models it) of 989 dense bf16" in plain
  assert cli.main(["plan", "h200x8/deepseek3-proxy-16b", "--time"]) == 0
  timed = capfd.readouterr().out
  assert "MFU of" not in timed and "at an assumed" not in timed, "one tokens/s figure: the model's"
  (line,) = [x for x in timed.splitlines() if x.startswith("  throughput: ")]
  (predicted,) = [x for x in timed.splitlines() if x.endswith(" bf16 peak")]
  assert line.split("below, ")[1].split(" tokens/s")[0] == predicted.split()[0], (line, predicted)


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
@pytest.mark.slow
def test_search_write_replaces_a_file_only_with_force(tmp_path):
  out = tmp_path / "tiny.yml"
  out.write_text("base_config: mine\n")
  args = ["plan", "deepseek3-tiny", "--gpu", "h100", "--nodes", "1", "--search", "--write", str(out)]
  r = run_cli(args, cwd=tmp_path)
  assert r.returncode == 2 and "already exists; pass --force to replace it" in r.stderr
  assert out.read_text() == "base_config: mine\n"
  r = run_cli([*args, "--force"], cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "model_name: deepseek3-tiny" in out.read_text() and sorted(p.name for p in tmp_path.iterdir()) == [out.name]
