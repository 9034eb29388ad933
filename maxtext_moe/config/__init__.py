"""Plugin configuration: our keys, cross-field checks and recipe resolution."""
