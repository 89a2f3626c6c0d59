"""Serving benchmark (`python -m minisgl.bench`), in sglang bench_serving's conventions."""
