"""What a `maxtext-moe k8s` pod asks for beyond its GPUs and the checkpoint claim, from the user's flags:
RDMA NICs (--rdma-resource NAME=COUNT) and more claims, read-only (--data-claim NAME[:MOUNT]). Each flag is
checked here, one line with the fix, before any manifest is written. And the overrides this machine checks
a recipe with, where a path names a file only the pods have."""

from pathlib import Path

from maxtext_moe.errors import UserError

DATA_MOUNT = "/data"
POD_PATHS = ("model_file", "load_parameters_path", "tokenizer_path")


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
