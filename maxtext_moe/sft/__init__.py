"""Supervised fine-tuning on conversations, before MaxText's SFT pipeline takes over.

  conversations.py  rows read and checked (JSONL or Parquet, a `messages` column), JSONL staged as Parquet
  prepare.py        every check before training, the length and pad-id measurements, `data show`
The MaxText side (its tokenizer and grain pipeline, our whole-conversation rendering) is
`upstream/maxtext/sft_data.py`; the embedded example's data is `data/arithmetic.py`.
"""
