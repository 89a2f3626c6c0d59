"""Tokenizer and detokenizer workers, and incremental detokenization."""
