"""A conversation rendered whole by the tokenizer's own chat template, and which of its tokens carry loss.

MaxText 0.2.5's SFT pipeline (`input_pipeline_utils.apply_chat_template`) renders each user/assistant round
on its own, decodes it to text and encodes each chunk again. Every round then begins with a BOS of its own:
Mixtral's `... 4</s><s> [INST] ...` where its template, and so vLLM serving the model, writes `... 4</s>
[INST] ...`; and a template that renders a turn by its place in the conversation (Qwen3 writes an empty
`<think>` block into the last assistant turn only) was trained on turns no server shows the model. Here the
whole conversation goes through the template once: the ids are `tokenizer.apply_chat_template(messages,
tokenize=True)`'s, token for token (`render`).

The tokens that carry loss are each assistant reply and the template's end of its turn:
- A template with `{% generation %}` blocks marks them itself: transformers' `return_assistant_tokens_mask`.
- The templates of DeepSeek-V3, Qwen3 and Mixtral have none. Then each reply's span is found in the whole
  rendering's characters by rendering prefixes of the conversation with the same template, and mapped to
  tokens by their offsets as transformers maps generation blocks (a token that overlaps a span is in it):
  the reply of turn i starts where the rendering first departs from the prompt a server sends for it
  (turns before i with the generation prompt): what the template writes after that is the model's to
  produce (Qwen3's think block of the last turn too). It ends with the template's end of turn: the text
  the template writes after a stand-in reply (`PROBE`) put as turn i, up to and including its first
  special token (`<|im_end|>` for Qwen3 and not the newline after it, which generation, stopping at
  `<|im_end|>`, never produces; `</s>` for Mixtral; `<｜end▁of▁sentence｜>` for DeepSeek-V3), found again
  in the whole rendering from the reply's start.
  This is right for any template because every boundary is where the template's own output puts it:
  nothing about a format (role headers, BOS, system prompt, think blocks) is assumed, and prefixes a
  template renders differently (Qwen3's earlier turns without think blocks) only move a boundary to where
  the two renderings differ. It assumes what serving assumes: a reply does not contain its end-of-turn
  text (the tokenizer would encode it as the special token, where generation stops). transformers'
  `return_assistant_tokens_mask` masks nothing without generation blocks, and prefix token ids (MaxText's
  way) differ from the whole conversation's where a token spans a boundary.
"""

import re
from collections.abc import Iterable
from typing import Any

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' test for `{% generation %}`
PROBE = "maxtext-moe stand-in reply"


def turns(messages: Iterable[dict]) -> list[dict]:
  """The conversation the template is given: each turn's role and content, nothing else. JSONL is staged
  with these alone (`sft.conversations`), so a Parquet row's other fields (`reasoning_content`,
  `tool_calls`, ...) are dropped too: the same conversations render the same from either, and every check
  renders what the trainer does."""
  return [{"role": turn["role"], "content": turn["content"]} for turn in messages]


def _text(hf: Any, messages: list[dict], *, prompt: bool = False) -> str:
  return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def _common(a: str, b: str) -> int:
  """Length of the common prefix of a and b."""
  n = min(len(a), len(b))
  return next((k for k in range(n) if a[k] != b[k]), n)


def end_of_turn(hf: Any, before: list[dict]) -> str:
  """What the template writes after an assistant reply that follows `before`, through its first special
  token (all of it where it has none). Raises ValueError when it writes nothing, or drops the reply."""
  text = _text(hf, [*before, {"role": "assistant", "content": PROBE}])
  at = text.rfind(PROBE)
  if at < 0:
    raise ValueError("the chat template does not write an assistant turn's content")
  tail = text[at + len(PROBE) :]
  if not tail:
    raise ValueError("the chat template writes nothing after an assistant reply, so no end of turn to learn")
  special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
  enc = hf(tail, add_special_tokens=False)
  ends = [end for i, (_, end) in zip(enc["input_ids"], enc.encodings[0].offsets, strict=True) if i in special]
  return tail[: ends[0]] if ends else tail


def reply_spans(hf: Any, messages: list[dict], text: str) -> list[tuple[int, int]]:
  """(start, end) in `text`, the whole conversation rendered, of each assistant reply with its end of turn."""
  spans = []
  for i, turn in enumerate(messages):
    if turn["role"] != "assistant":
      continue
    if i == 0:
      raise ValueError("turn 0 is an assistant turn: nothing before it prompts it")
    start = _common(_text(hf, messages[:i], prompt=True), text)
    eot = end_of_turn(hf, messages[:i])
    found = text.find(eot, start)
    if found < 0:
      raise ValueError(f"turn {i}: the template's end of turn {eot!r} does not follow the reply")
    spans.append((start, found + len(eot)))
  return spans


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
  """Each token (its character offsets) overlaps one of `spans`: transformers' rule for generation blocks."""
  return [any(end > s and start < e for s, e in spans) for start, end in offsets]


def render(hf: Any, messages: list[dict]) -> tuple[list[int], list[bool]]:
  """(token ids of the whole conversation, as `hf.apply_chat_template(messages, tokenize=True)` gives them;
  whether each carries loss: the assistant replies and their ends of turn). Raises whatever the template
  raises, and ValueError where a reply's span cannot be found."""
  if GENERATION_BLOCK.search(hf.get_chat_template()):
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
  out = hf.apply_chat_template(messages, tokenize=True, return_dict=True)
  if not out.encodings:
    raise ValueError("the tokenizer gives no character offsets (a tokenizer.json one does)")
  spans = reply_spans(hf, messages, _text(hf, messages))
  return list(out["input_ids"]), _overlapping(out.encodings[0].offsets, spans)


def runs(ids: list[int], carries: list[bool]) -> tuple[list[list[int]], list[bool]]:
  """`ids` cut where `carries` changes: MaxText's SFT chunks and their `is_prompt` (not carrying loss)."""
  chunks, is_prompt = [], []
  for token, carry in zip(ids, carries, strict=True):
    if not chunks or is_prompt[-1] == carry:
      chunks.append([])
      is_prompt.append(not carry)
    chunks[-1].append(token)
  return chunks, is_prompt
