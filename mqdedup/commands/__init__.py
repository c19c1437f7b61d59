"""The implementations of the ``mqdedup`` sub-commands (the parser lives in mqdedup.cli)."""
