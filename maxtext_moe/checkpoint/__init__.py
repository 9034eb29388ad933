"""Hugging Face <-> MaxText checkpoint conversion for DeepSeek-V3, streamed tensor group by tensor group."""
