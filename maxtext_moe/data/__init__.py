"""Offline training data."""
