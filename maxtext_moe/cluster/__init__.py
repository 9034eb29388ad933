"""Multi-process jobs: where each process sits, and the launchers that start them.

  placement.py   which process, which GPU, which coordinator (flags, `launch`'s variables, SLURM)
  supervisor.py  `maxtext-moe launch --nproc-per-node N`: one process per GPU on this node
  k8s.py         `maxtext-moe k8s`: a JobSet (or indexed Job + Service) running `launch` on every node
  k8s_pod.py     what a pod asks for beyond its GPUs: RDMA NICs, data claims
  fit.py         plan's verdict before a job is written or fanned out (`k8s`, `plan --check`)
scripts/slurm/train.sbatch is the SLURM side (srun starts the processes; placement.py reads SLURM's variables).
"""
