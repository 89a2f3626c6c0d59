"""OpenAI-compatible HTTP service: launcher, API server, process management.

Nothing below server/ imports from here: the workers' life-cycle helpers live in
minisgl.process.
"""
