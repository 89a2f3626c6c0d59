"""Runs batches through the model on a device; `Engine` is the token-level core of minisgl."""
