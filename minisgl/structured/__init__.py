"""Structured generation: grammar-constrained decoding (xgrammar) and the parsers that turn a
Qwen3 completion into OpenAI fields (tool calls, reasoning).

The parsers and the request-side specs are pure Python (the API server imports them); only
grammar.py touches xgrammar and torch, and only in the scheduler's process.
"""
