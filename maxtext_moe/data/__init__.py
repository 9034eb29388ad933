"""Offline training data: the standard-library corpus and the SFT example (two-digit addition)."""
