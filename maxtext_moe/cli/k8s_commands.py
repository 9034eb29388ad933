"""`maxtext-moe k8s RECIPE --image IMAGE`: the Kubernetes manifests of a training job (cluster/k8s.py), printed
as YAML once the recipe, its node layout and its memory are checked."""

import argparse
import sys
from typing import IO

from maxtext_moe.cli.run_commands import add_nodes_option, split_recipe
from maxtext_moe.errors import UserError


def _k8s(ns: argparse.Namespace, out: IO[str]) -> int:
  import re

  import yaml

  from maxtext_moe.cluster import k8s

  recipe, overrides = split_recipe(ns.args)
  if recipe is None:
    raise UserError("k8s needs a RECIPE (see 'maxtext-moe recipes')")
  given = [o.partition("=")[2] for o in overrides if o.startswith("nodes=")]  # the YAML key as an override
  overrides = [o for o in overrides if not o.startswith("nodes=")]
  if ns.nodes is None and given and not given[-1].isdigit():
    raise UserError(f"nodes={given[-1]}: give a whole number of nodes")
  nodes = ns.nodes if ns.nodes is not None else int(given[-1]) if given else -1  # -1: the recipe's
  if nodes == 0 or nodes < -1:
    raise UserError(f"--nodes must be >= 1, got {nodes}")
  if ns.gpus_per_node is not None:
    overrides.append(f"gpus_per_node={ns.gpus_per_node}")
  name = ns.name or re.sub(r"[^a-z0-9-]+", "-", recipe.split("/")[-1].lower()).strip("-")
  request = k8s.Request(
    name=name,
    recipe=recipe,
    overrides=overrides,
    nodes=nodes,
    image=ns.image,
    kind=ns.kind,
    checkpoint_claim=ns.checkpoint_claim,
    data_claims=tuple(ns.data_claim or ()),
    staging_claim=ns.staging_claim or "",
    fit_check=not ns.no_fit_check,
    max_restarts=ns.max_restarts,
    topology_key=ns.topology_key,
    rdma_resource=ns.rdma_resource or "",
    compute_domain=not ns.no_compute_domain,
  )

  class _NoAliases(yaml.SafeDumper):  # repeated label maps written out, not as &id001 anchors
    def ignore_aliases(self, data):
      return True

  resolved, docs = k8s.for_recipe(request)
  print(yaml.dump_all(docs, Dumper=_NoAliases, sort_keys=False), end="", file=out)
  print(f"maxtext-moe: note: {resolved.at_risk}", file=sys.stderr)  # stdout is the manifests
  return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:

  p = sub.add_parser(
    "k8s",
    parents=[common],
    help="write the Kubernetes manifests (JobSet, or indexed Job + Service) for a training job",
    description="Print, as YAML, the manifests that train RECIPE on its nodes (or --nodes N) of the recipe's "
    "GPUs: one pod per node running 'maxtext-moe launch --nproc-per-node G --nnodes N -- train RECIPE ...' "
    "from IMAGE, with the coordinator and node count set, the recipe's XLA/NCCL environment, a memory-backed "
    "/dev/shm, a PersistentVolumeClaim at /checkpoints (base_output_directory), a staging cache at /staging "
    "(JSONL data written as Parquet once per pod, or once for the job with --staging-claim) and any "
    "--data-claim read-only. A pod that stops on a bad row (exit 65) or bad input (2) fails the job without a "
    "restart. The run name is pinned (run_name=..., else --name), so a restart or the manifest applied "
    "again continues the run. The recipe, overrides and node count are checked first as 'maxtext-moe plan' "
    "checks them (whole NVLink domains, tensors that divide, memory that fits), so a layout that cannot run "
    "fails here, in one line with the nearest node count or plan's cheapest fix, and nothing is printed. "
    "GB200/GB300 racks get a "
    "ComputeDomain (NVIDIA's DRA driver: the IMEX channel multi-node NVLink needs) and one Job per rack "
    "placed by --topology-key. A recipe file goes to the pods as a ConfigMap. --kind jobset (default) needs "
    "the JobSet controller, which restarts the whole job on a failure (up to --max-restarts); --kind job is "
    "an indexed Job plus a headless Service. docs/cluster.md says what the cluster must provide.",
    epilog="Example: maxtext-moe k8s gb200-nvl72/deepseek3-671b --nodes 32 --image REGISTRY/maxtext-moe:0.1.0 "
    "--rdma-resource rdma/ib=4 | kubectl apply -f -",
  )
  p.add_argument("args", nargs="*", metavar="RECIPE [key=value]")
  add_nodes_option(p)
  p.add_argument("--image", required=True, help="the maxtext-moe image (docker/build.sh)")
  p.add_argument(
    "--kind", choices=["jobset", "job"], default="jobset", help="JobSet (default) or indexed Job + Service"
  )
  p.add_argument(
    "--name",
    help="object name, and the run_name unless you set one (default: the recipe's last path part in lowercase, "
    "other characters as '-': h100x8/deepseek3-671b -> deepseek3-671b, my_run.yml -> my-run-yml); the same "
    "name continues the same run",
  )
  p.add_argument("--gpus-per-node", type=int, help="GPUs per pod (the key gpus_per_node); default: the hardware's")
  _add_volume_options(p)
  p.add_argument(
    "--no-fit-check",
    action="store_true",
    help="write the manifests even where 'maxtext-moe plan' estimates the layout does not fit memory (the node "
    "layout and tensor divisibility are still checked)",
  )
  p.add_argument("--max-restarts", type=int, default=3, help="jobset: whole-job restarts on failure (3)")
  _add_rack_options(p)
  p.set_defaults(func=_k8s)


def _add_volume_options(p: argparse.ArgumentParser) -> None:
  """The claims every pod mounts: checkpoints, the staging cache, data."""
  from maxtext_moe.cluster import k8s as k8s_defaults  # pylint: disable=import-outside-toplevel

  p.add_argument(
    "--checkpoint-claim",
    default=k8s_defaults.CHECKPOINT_CLAIM,
    help=f"the PersistentVolumeClaim mounted at /checkpoints, ReadWriteMany (default {k8s_defaults.CHECKPOINT_CLAIM})",
  )
  p.add_argument(
    "--data-claim",
    action="append",
    metavar="NAME[:MOUNT]",
    help="another PersistentVolumeClaim (datasets, tokenizers, converted weights), mounted read-only at MOUNT "
    "(default /data) in every pod; repeat for more claims, each at its own MOUNT. Any other volume (NFS, a "
    "host path, a CSI driver) reaches the pods as a claim bound to a PersistentVolume of it",
  )
  p.add_argument(
    "--staging-claim",
    metavar="NAME",
    help="a PersistentVolumeClaim mounted at /staging, where train writes JSONL data as Parquet before it reads "
    "it (MAXTEXT_MOE_CACHE); ReadWriteMany, it is staged once for the job and kept across restarts. Default: "
    "node-local disk (an emptyDir), staged once per pod",
  )


def _add_rack_options(p: argparse.ArgumentParser) -> None:
  """RDMA NICs and GB200/GB300 racks: what the pods ask of the cluster's device plugins and DRA driver."""
  p.add_argument(
    "--rdma-resource",
    metavar="NAME=COUNT",
    help="RDMA NICs per pod by the resource name your cluster's device plugin gives them, e.g. rdma/ib=4",
  )
  p.add_argument(
    "--topology-key",
    default="nvidia.com/gpu.clique",
    help="GB200/GB300: the node label that names an NVL72 rack's NVLink clique; the pods of one NVLink domain "
    "are placed on one value of it (default nvidia.com/gpu.clique, set by NVIDIA's GPU feature discovery)",
  )
  p.add_argument(
    "--no-compute-domain",
    action="store_true",
    help="GB200/GB300: do not create a ComputeDomain (NVIDIA's DRA driver) nor claim its IMEX channel, for "
    "clusters that set IMEX up outside Kubernetes",
  )
