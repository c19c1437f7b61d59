"""Django integration (placeholder; see issue #14)."""
