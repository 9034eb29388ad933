"""Keys the launcher derives from the merged YAML layers and overrides before MaxText resolves them: the
job's node layout (`config.nodes`: devices, NVLink domains, the cross-node axis) and a vocabulary sized
from the tokenizer (`vocab_from_tokenizer`)."""

import omegaconf

from maxtext_moe.config import nodes
from maxtext_moe.config.keys import PluginKeys
from maxtext_moe.config.layers import layer_value
from maxtext_moe.data import text
from maxtext_moe.errors import UserError
from maxtext_moe.moe.layout import DCN, ICI, SUFFIX


def _degrees(cfg: omegaconf.DictConfig, prefix: str) -> dict[str, int]:
  """{axis: degree} of the merged layers' `<prefix><axis>_parallelism` keys."""
  out = {}
  for key in cfg:
    axis = str(key)[len(prefix) : -len(SUFFIX)]
    if str(key).startswith(prefix) and str(key).endswith(SUFFIX) and axis:
      value = layer_value(cfg, str(key))
      if isinstance(value, int) and not isinstance(value, bool):
        out[axis] = value
  return out


def node_layout(cfg: omegaconf.DictConfig, plugin: PluginKeys) -> nodes.NodeLayout:
  """The job the merged layers and overrides describe on their `nodes` (`config.nodes.scale`)."""
  slices = layer_value(cfg, "num_slices")
  return nodes.scale(
    plugin.recipe_hardware,
    nodes=plugin.nodes,
    ici=_degrees(cfg, ICI),
    dcn=_degrees(cfg, DCN),
    recipe_devices=plugin.recipe_num_devices,
    num_slices=int(slices) if isinstance(slices, int) else -1,
    gpus_per_node_override=plugin.gpus_per_node,
  )


def vocab_from_tokenizer(cfg: omegaconf.DictConfig, plugin: PluginKeys, overrides: list[str]) -> list[str]:
  """`vocab_size=N` from the Hugging Face tokenizer when vocab_from_tokenizer is set (N: its length rounded
  up to 128, `data.text.vocab_for`), else []."""
  if not plugin.vocab_from_tokenizer:
    return []
  if any(o.startswith("vocab_size=") for o in overrides):
    raise UserError("vocab_from_tokenizer=true sizes the vocabulary from the tokenizer: drop vocab_size=")
  if layer_value(cfg, "finetune") or layer_value(cfg, "load_parameters_path"):
    raise UserError(
      "vocab_from_tokenizer=true is for training from scratch: a checkpoint's vocabulary is its own; drop it"
    )
  if str(layer_value(cfg, "tokenizer_type")) != "huggingface":
    raise UserError("vocab_from_tokenizer=true reads a Hugging Face tokenizer: set tokenizer_type=huggingface")
  return [f"vocab_size={text.vocab_for(text.tokenizer_size(str(layer_value(cfg, 'tokenizer_path'))))}"]
