"""Launching MaxText's trainer with the plugin: config preparation, progress, run outputs."""
