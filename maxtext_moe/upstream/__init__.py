"""Every seam to the upstream packages (MaxText 0.2.5, Orbax), one concern per module. Nothing else in
maxtext_moe imports them (tests/test_upstream_contract.py), and importing these modules changes nothing:
patches are installed by `patches.install`/`installed`, resolvers by `config.install_resolvers`.

  manifest.py   every upstream symbol we use, pinned to its exact signature (manifest.json)
  config.py     our keys in MaxText's config class; the layer read and the one resolution per process
  patches.py    install()/uninstall() of attribute replacements, the originals kept here
  moe_layer.py  the dropless block in place of RoutedMoE.sparse_matmul
  trainer.py    the trainer hook: MaxText's loop on our resolved config, its steps to our recorder
  model.py      the parameter tree, a forward pass from a checkpoint, one MoE layer for benchmarks
  compile.py    MaxText's FLOPs count, the compiled step's memory, the step lowered for any platform
  orbax.py      Orbax's type-handler extension point and TensorStore specs (its private modules)
"""
