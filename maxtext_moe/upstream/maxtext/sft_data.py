"""MaxText's grain data paths, reached from outside its trainer: the tokenizer it builds, its rendering of
a conversation into prompt and completion chunks, and its grain SFT and pretraining pipelines on rows we
hand it.

The launcher's checks (`sft.conversations`) and `maxtext-moe data show` call these, so what they measure
and print is what MaxText's trainer will feed the model, not a re-implementation of it.
"""

from collections.abc import Iterator
from typing import Any

import numpy as np
from maxtext.input_pipeline import data_processing_utils, grain_data_processing, input_pipeline_utils


def tokenizer(cfg: Any) -> tuple[Any, int]:
  """(the Hugging Face tokenizer MaxText's SFT pipeline uses, with the config's chat template if set; the
  pad id that masks targets)."""
  built, pad_id = data_processing_utils.get_tokenizer_and_pad_id(cfg)
  hf = getattr(built, "tokenizer", built)
  if cfg.chat_template:
    hf.chat_template = cfg.chat_template
  return hf, int(pad_id)


def render(hf: Any, messages: list[dict]) -> tuple[list[list[int]], list[bool]]:
  """MaxText's chunks of one conversation: token ids of each prompt and completion, and which are prompts.
  Raises whatever the chat template raises."""
  example = input_pipeline_utils.apply_chat_template({"messages": messages}, hf, "messages")
  return [list(hf.encode(chunk)) for chunk in example["messages"]], list(example["is_prompt"])


def prompt_ids(hf: Any, messages: list[dict]) -> list[int]:
  """The generation prompt for a conversation's turns before its last assistant turn, as MaxText splits it."""
  chunks, is_prompt = render(hf, messages)
  last = max(i for i, p in enumerate(is_prompt) if not p)
  return [t for chunk in chunks[:last] for t in chunk]


def batches(cfg: Any, rows: list[dict], columns: list[str]) -> Iterator[dict[str, np.ndarray]]:
  """MaxText's grain SFT pipeline (chat template, completion masking, packing, shift) over `rows`."""
  import grain.python as grain  # pylint: disable=import-outside-toplevel

  dataset = grain.MapDataset.source(rows).to_iter_dataset()
  return iter(
    grain_data_processing.sft_preprocessing_pipeline(
      dataset, cfg, columns, tokenize=True, grain_worker_count=0, grain_per_worker_buffer_size=1
    )
  )


def pretrain_batches(cfg: Any, rows: list[dict], column: str) -> Iterator[dict[str, np.ndarray]]:
  """MaxText's grain pretraining pipeline (tokenize, chunk to max_target_length, pack, shift) over `rows`."""
  import grain.python as grain  # pylint: disable=import-outside-toplevel

  dataset = grain.MapDataset.source(rows).to_iter_dataset()
  return iter(
    grain_data_processing.pretrain_preprocessing_pipeline(
      dataset, cfg, [column], tokenize=True, grain_worker_count=0, grain_per_worker_buffer_size=1
    )
  )


def decoder(cfg: Any) -> Any:
  """ids -> text with the tokenizer MaxText's pipeline builds for `cfg`."""
  return data_processing_utils.get_tokenizer_and_pad_id(cfg)[0].decode
