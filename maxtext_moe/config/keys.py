"""The plugin's own config keys.

These are plain pydantic fields with no MaxText import, so they can be listed, documented and
snapshot-tested on a bare install. `maxtext_moe.upstream.resolution` mixes them into MaxText's
`MaxTextConfig`, which forbids unknown keys, so a misspelled plugin key is an error like any other.
"""

from enum import StrEnum

from pydantic import BaseModel, Field, field_validator

from maxtext_moe.config.hardware import Hardware
from maxtext_moe.config.offload import OffloadPreset
from maxtext_moe.moe.settings import (
  DEFAULT_BUFFER_FACTOR,
  BufferMode,
  DispatchKind,
  GemmBackend,
  GemmQuantization,
  MoEImpl,
)

# Which XLA/NCCL flag profile (configs/flags/profiles.yml) a run uses: auto (the one named by
# recipe_hardware), disabled (not "none"/"off", see Progress), or any hardware's own profile. Built from
# the hardware table so that a new GPU model is a new profile name without a second list to keep in step.
FlagProfile = StrEnum("FlagProfile", {"AUTO": "auto", "DISABLED": "disabled", **{h.name: h.value for h in Hardware}})


class Progress(StrEnum):
  """How the launcher shows per-step progress."""

  AUTO = "auto"  # rich on a terminal, plain lines otherwise
  RICH = "rich"
  PLAIN = "plain"
  SILENT = "silent"  # not "none"/"off": MaxText turns "none" into None and YAML reads "off" as False


class NonFinitePolicy(StrEnum):
  """What a NaN or Inf training loss does."""

  STOP = "stop"  # stop with one line: the step, the last good checkpoint, what to try
  SKIP = "skip"  # skip the step's update (optax.apply_if_finite), count it; stop after max_nonfinite_skips in a row


class Integrity(StrEnum):
  """What is recorded of each checkpoint when its save completes, and checked before it is restored."""

  CHECKSUMS = "checksums"  # every file's size and CRC-32
  SIZES = "sizes"  # every file's size (for checkpoints too large to read once more at each save)
  OFF = "off"


class Overlength(StrEnum):
  """What an SFT conversation longer than max_target_length does."""

  TRUNCATE = "truncate"  # keep its first max_target_length tokens (MaxText's SFT pipeline), and say how many
  REFUSE = "refuse"  # stop before training, naming the longest and where it is


class PluginKeys(BaseModel):
  """Keys that maxtext-moe adds to MaxText's config. Every one is settable from YAML or key=value."""

  recipe_hardware: Hardware = Field(Hardware.CPU, description="Hardware the recipe is laid out for.")
  recipe_num_devices: int = Field(
    -1,
    description="Total devices the job's layout expects; -1 means whatever is visible. On GPU recipes it "
    "follows from nodes (nodes x GPUs per node); the launcher refuses to start when the visible count differs.",
  )
  nodes: int = Field(
    -1,
    description="Nodes in the job (--nodes N on every command). A recipe's ICI degrees lay out one NVLink "
    "domain (an HGX node, or the nodes of one NVL72 rack); the DCN axis set to -1 takes the domains beyond "
    "it (data parallel unless the recipe says otherwise); num_slices and recipe_num_devices follow. -1: the "
    "recipe's recipe_num_devices in nodes, else 1. On CPU a node is one process.",
  )
  gpus_per_node: int = Field(
    0,
    ge=0,
    description="GPUs per node (0: the hardware's: 8 for h100/h200/b200/b300, 4 for gh200/gb200/gb300).",
  )
  moe_impl: MoEImpl = Field(
    MoEImpl.DROPLESS,
    description="dropless: our block replaces MaxText's sparse_matmul (needs sparse_matmul=true); "
    "maxtext: MaxText's own expert computation.",
  )
  moe_dispatch: DispatchKind = Field(
    DispatchKind.AUTO,
    description="Token dispatch, deduplicated per destination rank: local (no expert parallelism), "
    "all_to_all (portable; padded worst-case buffers on the wire), ragged_all_to_all (only real rows on the "
    "wire; GPU/TPU, slow on XLA:GPU), te_ep (Transformer Engine's NCCL EP; one GPU per process), auto "
    "(local at EP=1; on GPU te_ep where TE's EP can serve the job, else all_to_all; ragged_all_to_all on TPU; "
    "all_to_all on CPU). 'maxtext-moe doctor' says what auto picks here and why.",
  )
  moe_gemm_backend: GemmBackend = Field(
    GemmBackend.AUTO,
    description="Grouped GEMM: tiled (portable: one size-bucketed row window per expert), ragged_dot (jax.lax), "
    "tokamax, te (Transformer Engine's grouped_dense; GPU), auto (on GPU te where TE imports, else tiled; "
    "ragged_dot on TPU; tiled on CPU).",
  )
  moe_gemm_quantization: GemmQuantization = Field(
    GemmQuantization.NONE,
    description="Number format of the te grouped GEMM: none (bf16), fp8 (e4m3/e5m2, current scaling; SM89+) "
    "or mxfp8 (SM100+). Needs moe_gemm_backend te (or auto resolving to it).",
  )

  @field_validator("moe_gemm_quantization", mode="before")
  @classmethod
  def _none_is_bf16(cls, value: object) -> object:
    """MaxText reads the value `none` as None (found by a compile's own override): that is bf16."""
    return GemmQuantization.NONE if value is None else value

  moe_capacity_factor: float = Field(
    0.0,
    description="<= 0: dropless (buffers sized for the worst case). > 0: all_to_all buffers hold "
    "ceil(factor * tokens * top_k / EP) rows per rank, te_ep's receive buffer factor times balanced routing's "
    "need (>= 1); a step that overflows stops the run unless moe_allow_drops is true.",
  )
  moe_buffers: BufferMode = Field(
    BufferMode.BOUNDED,
    description="Expert-parallel buffers of all_to_all / ragged_all_to_all: bounded (moe_buffer_factor times "
    "the mean load; rows that do not fit go in further rounds, moe/rounds: dropless in bounded memory) or "
    "worst_case (one exchange sized for every token routed to one rank, or capped by moe_capacity_factor). "
    "te_ep sizes its own buffers.",
  )
  moe_buffer_factor: float = Field(
    DEFAULT_BUFFER_FACTOR,
    description="moe_buffers=bounded: each pair of ranks exchanges at most ceil(factor * tokens * top_k / EP) "
    "(row, expert) pairs per round; across nodes the network carries at most factor times the mean rows per "
    "node. At least 1 (the mean load): below it every step needs further rounds.",
  )

  @field_validator("moe_buffer_factor")
  @classmethod
  def _at_least_the_mean(cls, value: float) -> float:
    if value < 1.0:
      raise ValueError(
        f"moe_buffer_factor={value} sizes the dropless buffers below the mean load, so every step would need "
        "further rounds; use 1 or more (1.5 by default)"
      )
    return value

  moe_exchange_chunks: int = Field(
    0,
    ge=0,
    description="The bounded exchange's tokens in this many chunks, each with its own rounds, so that one "
    "chunk's dispatch and combine run beside another's expert GEMMs (XLA's latency-hiding scheduler). It must "
    "divide the tokens a device holds in each MoE layer (checked). 0: auto, 4 where expert parallelism spans "
    "nodes, else 1 (where 4 does not divide them, one chunk).",
  )
  moe_fp8_gather: bool = Field(
    True,
    description="With moe_gemm_quantization=fp8: gather the FSDP-split expert weights as the e4m3 codes and "
    "per-expert scales TE's FP8 grouped GEMM would make of them (half the bytes of a bf16 gather, the GEMM's "
    "inputs unchanged); false gathers bf16. No effect otherwise.",
  )
  moe_allow_drops: bool = Field(
    False,
    description="With moe_capacity_factor > 0: let assignments past the capacity be dropped (counted in "
    "moe/tokens_dropped each step) instead of stopping the run.",
  )
  progress: Progress = Field(Progress.AUTO, description="Per-step progress display of the launcher.")
  metrics_jsonl: str = Field(
    "metrics.jsonl", description="Per-step metrics file, relative to the run directory (one JSON object per step)."
  )
  loss_plot: str = Field(
    "loss.png", description="Loss-curve PNG written at the end, relative to the run directory; empty to skip."
  )
  offload: OffloadPreset | None = Field(
    None,
    description="Host-offload preset: none, optimizer, optimizer_params, activations or all; sets MaxText's "
    "optimizer/parameter host-offload keys and a custom remat policy (maxtext_moe/config/offload.py). Needs "
    "pinned host memory (GPU, TPU and CPU have it). Unset: MaxText's own offload keys as the layers set them.",
  )
  flag_profile: FlagProfile = Field(
    FlagProfile.AUTO,
    description="XLA/NCCL flag profile from configs/flags/profiles.yml: auto (the recipe_hardware's), "
    "a hardware name, or disabled. Printed by 'maxtext-moe flags RECIPE'.",
  )
  xla_flags_extra: list[str] = Field(
    default_factory=list,
    description="More XLA flags (--xla_name=value) after the profile's; one with the same name replaces "
    "the profile's. Each is checked against the installed jaxlib before launch.",
  )
  env_extra: list[str] = Field(
    default_factory=list,
    description="More environment variables (KEY=VALUE) after the profile's, e.g. NCCL_DEBUG=INFO.",
  )
  model_file: str = Field(
    "",
    description="A model YAML (written by 'maxtext-moe convert hf-to-maxtext' next to its checkpoint) whose "
    "model keys replace the recipe's, e.g. to fine-tune a converted Moonlight or Kimi-K2 on a recipe's layout.",
  )
  mla_norm_epsilon: float = Field(
    0.0,
    description="Epsilon of MLA's q/kv low-rank norms; 0: normalization_layer_epsilon. transformers' DeepseekV3 "
    "uses 1e-6 there whatever rms_norm_eps is, so models converted from Hugging Face set 1e-6.",
  )
  on_nonfinite_loss: NonFinitePolicy = Field(
    NonFinitePolicy.STOP,
    description="A NaN/Inf training loss: stop (one line naming the step and the last good checkpoint; the "
    "step is in metrics.jsonl, summary and plot are written) or skip (the step's update is not applied, the "
    "step is counted in metrics.jsonl as nonfinite_skipped; stop after max_nonfinite_skips in a row).",
  )
  max_nonfinite_skips: int = Field(
    3, ge=1, description="on_nonfinite_loss=skip: non-finite steps in a row to give up at."
  )
  checkpoint_integrity: Integrity = Field(
    Integrity.SIZES,
    description="sizes: when a checkpoint's save completes, process 0 records every file's size "
    "(STEP/maxtext_moe_files.json) and a restore checks them first, so a file cut short (a full disk, a copy "
    "killed half way) falls back to the previous checkpoint instead of failing mid-restore; checksums: also "
    "each file's CRC-32, which finds altered bytes but reads the whole checkpoint on process 0 at each save "
    "and resume (about 1 s per GB: hours for a 671B optimizer state); off: nothing.",
  )
  run_lock_wait_s: float = Field(
    0.0,
    ge=0.0,
    description="A run directory is written by one run at a time (a lock held while it runs; a killed run "
    "does not leave it stuck). 0: a second run with the same run_name refuses at once, naming the holder; "
    "N: it waits up to N seconds for the first to end.",
  )
  vocab_from_tokenizer: bool = Field(
    False,
    description="Pretraining from scratch on your own tokenizer: vocab_size becomes the Hugging Face tokenizer's "
    "length (tokenizer_path) rounded up to a multiple of 128, instead of the model file's. Off, a tokenizer "
    "larger than vocab_size is refused before training.",
  )
  checkpoint_fallback: bool = Field(
    True,
    description="When the newest checkpoint of a run cannot be read, resume from the newest one that can "
    "(the unreadable one is moved to RUN/unreadable_checkpoints/, with a warning); false: stop with one line.",
  )
  fault_nan_loss_steps: list[int] = Field(
    default_factory=list,
    description="Testing aid: these training steps' loss is replaced by NaN (counted from the run's first "
    "step, one train-step call each; needs gradient_accumulation_steps=1).",
  )
  moe_load_every: int = Field(
    10,
    ge=0,
    description="Every N steps (and at the last) write each MoE layer's per-expert load and mean |routing "
    "bias| to RUN/moe_load.jsonl, pictured in moe_load.png and moe_balance.png at the end; 0: never.",
  )
  sft_overlength: Overlength = Field(
    Overlength.TRUNCATE,
    description="use_sft: conversations longer than max_target_length tokens are truncated (the launcher "
    "says how many, before training) or refused (the run does not start).",
  )
  finetune: bool = Field(
    False,
    description="A fine-tuning run: refuse to start unless load_parameters_path (or load_full_state_path) "
    "names a checkpoint, so a run can never silently start from random weights. Set by *-finetune recipes.",
  )


PLUGIN_KEY_NAMES: tuple[str, ...] = tuple(PluginKeys.model_fields)
