"""Qwen3 in plain PyTorch, its config and its weight loader.

Import the submodules directly (importing `minisgl.models.config` stays torch-free; reading
a config.json imports transformers' config classes, and with them torch).
"""
