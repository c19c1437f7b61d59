"""The ``mqdedup`` command: worker supervisor, relay, replay, db, dedup, outbox, status, demo.

The entry point is :func:`mqdedup.cli.main.main`; each sub-command's work lives in
:mod:`mqdedup.cli.commands`.
"""
