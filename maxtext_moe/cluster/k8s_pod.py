"""What a `maxtext-moe k8s` pod asks for beyond its GPUs and the checkpoint claim, from the user's flags:
RDMA NICs (--rdma-resource NAME=COUNT) and more claims, read-only (--data-claim NAME[:MOUNT]). Each flag is
checked here, one line with the fix, before any manifest is written. The staging cache every pod has, and
the failure policy that keeps a run stopped by a bad row from being restarted. The run the pods train and
where its compiled programs are kept. And the overrides this machine checks a recipe with, where a path names
a file only the pods have."""

from pathlib import Path
from typing import Any

from maxtext_moe.data.corpus import CACHE_ENV
from maxtext_moe.errors import EXIT_DATAERR, UserError

DATA_MOUNT = "/data"
STAGING_MOUNT = "/staging"
CONTAINER = "trainer"


def staging(claim: str) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
  """(volume, mount, environment) of the pod's staging cache, where `train` writes JSONL as Parquet: once
  per pod, by the first of its processes while the others wait (`data.staging`). Node-local disk (an
  emptyDir) by default; with --staging-claim a claim every pod mounts, so that the job stages once."""
  if claim and not _claim_name_ok(claim):
    raise UserError(
      f"--staging-claim {claim!r}: give a PersistentVolumeClaim's name (lowercase letters, digits, '-', '.')"
    )
  source = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
  return {"name": "staging", **source}, {"name": "staging", "mountPath": STAGING_MOUNT}, {CACHE_ENV: STAGING_MOUNT}


# A pod whose trainer exits EXIT_DATAERR (a row the run cannot use, its last step saved) or 2 (bad input: a
# bad JSONL row as it is staged, a key, a path) fails its Job at once, and the JobSet with it
# (`jobset_failure_policy`): a restart would stop the same way.
NO_RESTART = [2, EXIT_DATAERR]
POD_FAILURE_POLICY = {
  "rules": [{"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": NO_RESTART}}]
}


def jobset_failure_policy(max_restarts: int) -> dict[str, Any]:
  """Restarts on any failure but a Job failed by `POD_FAILURE_POLICY` (JobSet v0.6+)."""
  rule = {"name": "data-error", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}
  return {"maxRestarts": max_restarts, "rules": [rule]}


POD_PATHS = ("model_file", "load_parameters_path", "tokenizer_path")
COMPILE_CACHE = "jax_cache"  # JAX's persistent compilation cache, in the run directory


def pinned(overrides: list[str], run: str, mount: str) -> list[str]:
  """What the pods' train command adds to the user's overrides: the run name (`run` unless given), so that
  every start continues one run, and MaxText's `jax_cache_dir` in that run on the checkpoint volume
  (MOUNT/RUN/jax_cache) unless given. JAX's persistent compilation cache there is written by process 0 and
  read by every process, so a restart loads the train step instead of compiling it; MaxText's default,
  ~/jax_cache, is inside the container and gone with it (docs/cluster.md)."""
  given = [o.partition("=")[2] for o in overrides if o.startswith("run_name=")]
  name = [] if given else [f"run_name={run}"]
  if any(o.startswith("jax_cache_dir=") for o in overrides):
    return name
  return [*name, f"jax_cache_dir={mount}/{(given or [run])[-1]}/{COMPILE_CACHE}"]


def rdma(given: str) -> dict[str, int]:
  """{resource name: NICs per pod} of --rdma-resource NAME=COUNT ({} for "")."""
  if not given:
    return {}
  name, _, count = given.partition("=")
  if not name or "/" not in name or not count.isdigit() or int(count) < 1:
    raise UserError(
      f"--rdma-resource {given!r}: give the NICs' resource name and count per pod, e.g. rdma/ib=4 "
      "(kubectl describe node shows the name under Allocatable)"
    )
  return {name: int(count)}


def _claim_name_ok(name: str) -> bool:
  """A PersistentVolumeClaim's name: a DNS-1123 subdomain."""
  parts = name.split(".")
  ok = all(p[:1].isalnum() and p[-1:].isalnum() for p in parts)
  return ok and len(name) <= 253 and all(c.islower() or c.isdigit() or c in "-." for c in name)


def _path_ok(mount: str) -> bool:
  return mount.startswith("/") and mount != "/" and not mount.endswith("/") and "//" not in mount and ":" not in mount


def data_mounts(given: tuple[str, ...], taken: dict[str, str]) -> list[tuple[str, str]]:
  """(claim, mount path) of each --data-claim NAME[:MOUNT] (MOUNT default /data), checked: a claim's name,
  an absolute path, none over or under another mount of the pod (`taken`: {path: whose})."""
  taken = dict(taken)
  out = []
  for flag in given:
    name, _, mount = flag.partition(":")
    mount = mount or DATA_MOUNT
    if not _claim_name_ok(name):
      raise UserError(
        f"--data-claim {flag!r}: give a PersistentVolumeClaim's name (lowercase letters, digits, '-' and '.'), "
        "then optionally :/MOUNT/PATH, e.g. --data-claim datasets:/data"
      )
    if not _path_ok(mount):
      raise UserError(f"--data-claim {flag!r}: the mount path must be absolute, e.g. {name}:/data/{name}")
    over = (what for path, what in taken.items() if mount == path or f"{mount}/".startswith(f"{path}/"))
    under = (what for path, what in taken.items() if path.startswith(f"{mount}/"))
    clash = next(over, None) or next(under, None)
    if clash:
      raise UserError(
        f"--data-claim {flag!r}: {mount} would share a path with {clash}; mount each claim at its own "
        f"path, e.g. {name}:/data/{name}"
      )
    taken[mount] = f"--data-claim {flag}"
    out.append((name, mount))
  return out


def here(overrides: list[str]) -> list[str]:
  """The overrides this machine checks the recipe with: a model_file, load_parameters_path or tokenizer_path
  that exists only in the pods (the checkpoint volume) is left out here (the layout is then checked on the
  recipe's own model) and passed to the pods as given."""
  gone = {k for k, _, v in (o.partition("=") for o in overrides) if k in POD_PATHS and v and not Path(v).exists()}
  gone |= {"vocab_from_tokenizer"} if "tokenizer_path" in gone else set()  # it reads the pods' tokenizer
  kept = [o for o in overrides if o.partition("=")[0] not in gone]
  return kept + (["finetune=false"] if "load_parameters_path" in gone else [])
