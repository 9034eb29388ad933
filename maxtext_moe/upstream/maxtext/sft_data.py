"""MaxText's grain data paths, reached from outside its trainer: the tokenizer it builds, a conversation
rendered into prompt and completion chunks, and its grain SFT and pretraining pipelines on rows we hand it.

MaxText 0.2.5 renders a conversation round by round (`input_pipeline_utils.apply_chat_template`), each
round decoded to text and encoded again with a BOS of its own; its SFT pipeline takes ours instead
(`patches`: the row rendered whole by the tokenizer's chat template, `chat.render`, into token-id chunks
that MaxText's `SFTPromptMasking`, packing and shift then take as before). The launcher's checks
(`sft.prepare`), the row check a run reads its data with (`ChatTemplate`), `maxtext-moe data check`,
`data show` and `eval` call the same functions, so what they judge, measure and print is what the trainer
feeds the model.
"""

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from maxtext.input_pipeline import data_processing_utils, grain_data_processing

from maxtext_moe.upstream.maxtext import chat
from maxtext_moe.upstream.patches import Patch, installed

PAIRS = (("prompt", "completion"), ("question", "answer"))  # MaxText's two-column SFT layouts, user first


def tokenizer(cfg: Any) -> tuple[Any, int]:
  """(the Hugging Face tokenizer MaxText's SFT pipeline uses, with the config's chat template if set; the
  pad id that masks targets)."""
  built, pad_id = data_processing_utils.get_tokenizer_and_pad_id(cfg)
  hf = getattr(built, "tokenizer", built)
  if cfg.chat_template:
    hf.chat_template = cfg.chat_template
  return hf, int(pad_id)


def render(hf: Any, messages: list[dict]) -> tuple[list[list[int]], list[bool]]:
  """A conversation's chunks as the trainer gets them: token ids of each prompt and completion (its turns'
  roles and contents, `chat.turns`, whole through the chat template, `chat.render`), and which are prompts.
  Raises whatever the chat template raises, and ValueError where a reply cannot be found in it."""
  return chat.runs(*chat.render(hf, chat.turns(messages)))


@dataclass(frozen=True)
class ChatTemplate:
  """A row check's chat template (`data.rows.ConversationRow`, made by `sft.prepare.row_check`):
  `template(messages)` renders one conversation as the trainer will (`render`), raising whatever its Jinja
  raises."""

  hf: Any

  def __call__(self, messages: list[dict]) -> tuple[list[list[int]], list[bool]]:
    return render(self.hf, messages)


def _messages(element: dict, data_columns: list[str]) -> list[dict]:
  """The row's conversation, as MaxText's `_format_chat_template_grain` reads it."""
  for user, assistant in PAIRS:
    if set(data_columns) == {user, assistant}:
      return [{"role": "user", "content": element[user]}, {"role": "assistant", "content": element[assistant]}]
  return [dict(turn) for turn in element[data_columns[0]]]


def format_conversation(element: dict, data_columns: list[str], tokenizer_model: Any) -> dict:
  """`grain_data_processing._format_chat_template_grain`, ours: the row's conversation rendered whole into
  token-id chunks, prompt and completion in turn, and their `is_prompt` (what MaxText's SFTPromptMasking
  takes)."""
  element[data_columns[0]], element["is_prompt"] = render(tokenizer_model, _messages(element, data_columns))
  return element


def tokenized_chunks(element: dict, text_column_name: str, tokenizer_model: Any) -> dict:
  """`grain_data_processing._tokenize_sft_chunks`, ours: `format_conversation`'s chunks are token ids."""
  del text_column_name, tokenizer_model
  return element


def patches() -> list[Patch]:
  """MaxText's SFT pipeline with the conversation rendered whole (for a run, `data show` and `eval`)."""
  return [
    Patch(grain_data_processing, "_format_chat_template_grain", format_conversation),
    Patch(grain_data_processing, "_tokenize_sft_chunks", tokenized_chunks),
  ]


def batches(cfg: Any, rows: list[dict], columns: list[str]) -> Iterator[dict[str, np.ndarray]]:
  """MaxText's grain SFT pipeline (ours rendering the chat template, its completion masking, packing and
  shift) over `rows`."""
  import grain.python as grain  # pylint: disable=import-outside-toplevel

  dataset = grain.MapDataset.source(rows).to_iter_dataset()
  build = functools.partial(grain_data_processing.sft_preprocessing_pipeline, dataset, cfg, columns, tokenize=True)
  with installed(patches()):  # its maps take our functions as they are built
    return iter(build(grain_worker_count=0, grain_per_worker_buffer_size=1))


def pretrain_batches(cfg: Any, rows: list[dict], column: str) -> Iterator[dict[str, np.ndarray]]:
  """MaxText's grain pretraining pipeline (tokenize, chunk to max_target_length, pack, shift) over `rows`."""
  import grain.python as grain  # pylint: disable=import-outside-toplevel

  dataset = grain.MapDataset.source(rows).to_iter_dataset()
  return iter(
    grain_data_processing.pretrain_preprocessing_pipeline(
      dataset, cfg, [column], tokenize=True, grain_worker_count=0, grain_per_worker_buffer_size=1
    )
  )


def encoder(cfg: Any) -> Any:
  """The tokenizer MaxText's pipeline builds for `cfg` (its `encode` adds BOS/EOS as the config says)."""
  return data_processing_utils.get_tokenizer_and_pad_id(cfg)[0]


def decoder(cfg: Any) -> Any:
  """ids -> text with the tokenizer MaxText's pipeline builds for `cfg`."""
  return data_processing_utils.get_tokenizer_and_pad_id(cfg)[0].decode
