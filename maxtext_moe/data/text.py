"""A Hugging Face tokenizer's size and the vocabulary a model trained from scratch on it gets
(`vocab_from_tokenizer`): its length rounded up to a multiple of 128. The corpus itself is checked and
staged by `pretrain.text`."""

import functools

from maxtext_moe.errors import UserError

VOCAB_MULTIPLE = 128  # the GEMM-friendly size MaxText's own vocabularies are padded to


@functools.lru_cache(maxsize=8)
def tokenizer_size(path: str) -> int:
  """The number of tokens of the Hugging Face tokenizer at `path` (its added tokens included); loaded once
  per process and path (every read of the layers with vocab_from_tokenizer asks)."""
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel

  try:
    return len(AutoTokenizer.from_pretrained(path))
  except (OSError, ValueError) as e:
    raise UserError(
      f"tokenizer_path={path}: no Hugging Face tokenizer loads from there ({str(e).splitlines()[0][:200]}); "
      "point it at a tokenizer directory (tokenizer.json, tokenizer_config.json)"
    ) from None


def vocab_for(size: int) -> int:
  """The vocab_size for a tokenizer of `size` tokens: rounded up to a multiple of 128."""
  return -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
