"""FastAPI integration (placeholder; see issue #13)."""
