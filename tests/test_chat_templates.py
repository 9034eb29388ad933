"""Issue 60: SFT renders a conversation whole with the tokenizer's own chat template, so training sees what
serving sees, and the loss falls on the assistant replies only; add_bos=true with a tokenizer that has no
BOS token (Qwen3) says what it does, or is refused where MaxText would fail.

The tokenizers are DeepSeek-V3's, Qwen3's and Mixtral's published chat templates and special tokens over a
tiny vocabulary (tests/fixtures/chat_tokenizers, written by tests/fixtures/make_chat_tokenizers.py). Token
ids are compared with `apply_chat_template(messages, tokenize=True)`'s whole; what carries loss is shown as
the rendered text with [[...]] around the characters of loss-carrying tokens, and each reply decoded.
"""

import pytest
from transformers import AutoTokenizer

from conftest import REPO
from maxtext_moe.config import recipes
from maxtext_moe.errors import UserError
from maxtext_moe.launch import preflight
from maxtext_moe.upstream.maxtext import sft_data
from maxtext_moe.upstream.maxtext.config import hyperparameters

FIXTURES = REPO / "tests" / "fixtures" / "chat_tokenizers"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONVERSATION = [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "What is 2 + 2?"},
  {"role": "assistant", "content": "It is 4."},
  {"role": "user", "content": "And 3 + 3?"},
  {"role": "assistant", "content": "6, twice 3."},
]
# The rendering, [[...]] around what carries loss: each reply and its end of turn, nothing of the prompts.
MARKED = {
  "deepseek3": "<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2 + 2?<｜Assistant｜>"
  "[[It is 4.<｜end▁of▁sentence｜>]]<｜User｜>And 3 + 3?<｜Assistant｜>[[6, twice 3.<｜end▁of▁sentence｜>]]",
  "qwen3": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
  "<|im_start|>assistant\n[[It is 4.<|im_end|>]]\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
  "<|im_start|>assistant\n[[<think>\n\n</think>\n\n6, twice 3.<|im_end|>]]\n",
  # One BOS, where the template writes it: `</s> [INST]`, not MaxText's round-by-round `</s><s> [INST]`.
  "mixtral": "<s> [INST] Be brief.\n\nWhat is 2 + 2? [/INST][[ It is 4.</s>]] [INST] And 3 + 3? [/INST]"
  "[[ 6, twice 3.</s>]]",
}
REPLIES = {  # the loss-carrying chunks decoded: the contents and the template's end of turn
  "deepseek3": ["It is 4.<｜end▁of▁sentence｜>", "6, twice 3.<｜end▁of▁sentence｜>"],
  "qwen3": ["It is 4.<|im_end|>", "<think>\n\n</think>\n\n6, twice 3.<|im_end|>"],  # the last turn's think block
  "mixtral": ["It is 4.</s>", "6, twice 3.</s>"],  # the reply's leading space is its first token, "▁"
}


def _marked(hf, ids: list[int], carries: list[bool]) -> str:
  """The rendered conversation with [[...]] around the characters that loss-carrying tokens cover."""
  text = hf.apply_chat_template(CONVERSATION, tokenize=False)
  enc = hf(text, add_special_tokens=False)
  assert enc["input_ids"] == ids
  covered = [False] * len(text)
  for (start, end), carry in zip(enc.encodings[0].offsets, carries, strict=True):
    for k in range(start, end):
      covered[k] = covered[k] or carry
  out = []
  for k, ch in enumerate(text):
    if covered[k] and (k == 0 or not covered[k - 1]):
      out.append("[[")
    out.append(ch)
    if covered[k] and (k + 1 == len(text) or not covered[k + 1]):
      out.append("]]")
  return "".join(out)


@pytest.mark.parametrize("family", sorted(MARKED))
def test_a_conversation_is_rendered_whole_with_the_loss_on_the_replies(family):
  hf = AutoTokenizer.from_pretrained(FIXTURES / family)
  chunks, is_prompt = sft_data.render(hf, CONVERSATION)
  ids = [t for c in chunks for t in c]
  carries = [not p for c, p in zip(chunks, is_prompt, strict=True) for _ in c]
  assert ids == hf.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"]
  assert _marked(hf, ids, carries) == MARKED[family]
  assert [hf.decode(c, skip_special_tokens=False) for c, p in zip(chunks, is_prompt, strict=True) if not p] == (
    REPLIES[family]
  )


def test_a_template_with_generation_blocks_marks_the_replies_itself():
  """Where the template marks what the assistant generates ({% generation %}), its marks are the mask:
  transformers' `return_assistant_tokens_mask`, token for token."""
  hf = AutoTokenizer.from_pretrained(FIXTURES / "qwen3")
  hf.chat_template = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}"
  )
  chunks, is_prompt = sft_data.render(hf, CONVERSATION)
  ids = [t for c in chunks for t in c]
  want = hf.apply_chat_template(CONVERSATION, tokenize=True, return_assistant_tokens_mask=True)
  assert ids == want["input_ids"]
  assert [not p for c, p in zip(chunks, is_prompt, strict=True) for _ in c] == [
    bool(m) for m in want["assistant_masks"]
  ]
  assert [hf.decode(c, skip_special_tokens=False) for c, p in zip(chunks, is_prompt, strict=True) if not p] == [
    "It is 4.<|im_end|>",
    "6, twice 3.<|im_end|>",
  ]


def _cfg(resolution, family: str, *overrides: str):
  keys = ["finetune=false", f"tokenizer_path={FIXTURES / family}", "per_device_batch_size=1", "max_target_length=128"]
  return hyperparameters(resolution.resolve(recipes.recipe_path("cpu/deepseek3-tiny-sft"), [*keys, *overrides]))


@pytest.mark.parametrize("family", sorted(MARKED))
def test_the_trainers_pipeline_packs_the_whole_rendering_and_masks_the_prompts(family, resolution):
  """MaxText's SFT pipeline as the trainer runs it (packing, completion-only masking, shift): the packed row
  is the whole rendering token for token, and the loss-carrying targets are the replies' tokens, but for
  any equal to the pad id, which MaxText masks by id (DeepSeek-V3's pad token is its end of sentence: the
  launcher notes it)."""
  cfg = _cfg(resolution, family)
  hf, pad_id = sft_data.tokenizer(cfg)
  chunks, is_prompt = sft_data.render(hf, CONVERSATION)
  batch = next(sft_data.batches(cfg, [{"messages": CONVERSATION}], ["messages"]))
  used = int((batch["inputs_segmentation"][0] != 0).sum())
  assert batch["inputs"][0][:used].tolist() == hf.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"]
  carried = batch["targets"][0][batch["targets_segmentation"][0] != 0].tolist()
  assert carried == [t for c, p in zip(chunks, is_prompt, strict=True) if not p for t in c if t != pad_id]


def test_without_completion_only_every_next_token_carries_loss(resolution):
  cfg = _cfg(resolution, "qwen3", "sft_train_on_completion_only=false")
  hf, pad_id = sft_data.tokenizer(cfg)
  ids = hf.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"]
  batch = next(sft_data.batches(cfg, [{"messages": CONVERSATION}], ["messages"]))
  assert batch["targets"][0][batch["targets_segmentation"][0] != 0].tolist() == [t for t in ids[1:] if t != pad_id]


def _pretrain_cfg(resolution, *overrides: str):
  keys = ["dataset_type=grain", f"grain_train_files={REPO / 'README.md'}", "train_data_columns=[text]"]
  keys += ["tokenizer_type=huggingface", f"tokenizer_path={FIXTURES / 'qwen3'}", "vocab_from_tokenizer=true"]
  return resolution.resolve(recipes.recipe_path("cpu/deepseek3-tiny"), [*keys, *overrides])


def test_add_bos_without_a_bos_token_is_said_at_start_or_refused(resolution, capsys):
  """Qwen3's tokenizer has no BOS: MaxText's add_bos=true adds nothing, as Qwen3 was trained. A pretraining
  run says so in one line; SFT (the template writes what the model needs), add_bos=false and a tokenizer
  with a BOS say nothing; concat_then_split packing, which would put the missing BOS first in every row
  (grain raised from inside the pipeline), is refused with the fix."""
  preflight.check_bos(_pretrain_cfg(resolution))
  assert capsys.readouterr().err == (
    f"maxtext-moe: note: the tokenizer at {FIXTURES / 'qwen3'} has no BOS token (Qwen3's has none), so add_bos=true "
    "adds nothing: documents are packed without one, each ended by its EOS token (add_eos=true); set add_bos=false "
    "to say so\n"
  )
  preflight.check_bos(_pretrain_cfg(resolution, "add_bos=false"))
  preflight.check_bos(_pretrain_cfg(resolution, f"tokenizer_path={FIXTURES / 'mixtral'}"))
  preflight.check_bos(_cfg(resolution, "qwen3", "add_bos=true"))
  assert capsys.readouterr().err == ""
  with pytest.raises(UserError) as refused:
    preflight.check_bos(_pretrain_cfg(resolution, "grain_packing_type=concat_then_split"))
  assert str(refused.value) == (
    "add_bos=true with grain_packing_type=concat_then_split starts every packed row with the BOS token, and the "
    f"tokenizer at {FIXTURES / 'qwen3'} has no BOS token (Qwen3's has none); set add_bos=false"
  )
