"""Pipelines: running models and flows (capture, corpus readers, the demo)."""
