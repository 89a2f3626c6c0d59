"""OpenAI-compatible HTTP service: launcher, API server, process management.

Kept import-light: workers import minisgl.server.process without pulling in FastAPI.
"""
