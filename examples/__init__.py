"""Runnable mqdedup examples (see examples/README.md)."""
