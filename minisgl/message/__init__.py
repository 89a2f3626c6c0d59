"""Messages between the server's processes: one module per channel, msgpack on the wire.

API server -> tokenizer -> scheduler -> detokenizer -> API server (see docs/serving.md).
"""
