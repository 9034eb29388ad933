"""Every seam to the upstream packages (MaxText 0.2.5, Orbax, JAX's private symbols, Transformer Engine),
by concern. Nothing else in maxtext_moe imports them (tests/test_upstream_contract.py), and importing these
modules changes nothing: patches are installed by `patches.install`/`installed`, resolvers by
`maxtext.config.install_resolvers`.

  resolution.py  a recipe resolved top to bottom (file, YAML layers, model file, overrides, derived keys,
                 flag profile, MaxText's config with our keys): the only module here that reads config/
  maxtext/       MaxText's side: its config machinery, trainer hook, recovery, model, the MoE layer we
                 patch, weights load, SFT data, its compiled step
  pipeline/      MaxText's pipeline stages with MoE layers (the seam, circular records, remat, flat loads)
  te/            the Transformer Engine seam, its manifest and the stand-ins for a compile without a GPU
  manifest.py    every MaxText and Orbax symbol we use, pinned to its exact signature (manifest.json)
  patches.py     install()/uninstall() of attribute replacements, the originals kept here
  orbax.py       Orbax's type-handler extension point and TensorStore specs (its private modules)
  jax_backend.py whether a backend has started; JAX's cuDNN attention checks answered for a target GPU
"""
