"""MaxText 0.2.5's side of the seam: its trainer, model, checkpoints and data, each entered in one module.

trainer.py       the trainer hook: MaxText's loop on our resolved config, its steps to our recorder
recovery.py      stops, saves and non-finite losses inside MaxText's loop (when to save; MaxText saves)
model.py         the parameter tree, a forward pass from a checkpoint, one MoE layer for benchmarks
moe_layer.py     the dropless block in place of RoutedMoE.sparse_matmul
mesh.py          MaxText's device mesh across nodes whose devices report no NVLink partition (CPU)
mla_norm.py      the epsilon of MLA's low-rank norms, settable apart from the layer norms'
weights_load.py  MaxText's weights-only load, made to read what we write and to start FP8 runs
compile.py       MaxText's FLOPs count, the compiled step's memory, the step lowered for any platform
sft_data.py      MaxText's SFT data pipeline (its tokenizer and grain) for our files, rendering by chat.py
chat.py          a conversation whole through its chat template, and the tokens of the assistant replies
"""
