"""Qwen3 in plain PyTorch, its config and its weight loader.

Import the submodules directly (`minisgl.models.config` stays torch-free).
"""
