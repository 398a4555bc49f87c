"""Speculative decoding: guess the next tokens cheaply, check every guess in one forward, keep what the
model itself would have produced (see engine/speculation.py for how a step uses it)."""
