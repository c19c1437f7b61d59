"""The ``mqdedup`` command (worker supervisor, relay, replay, db, dedup, outbox,
dead-letters, status, demo; health and metrics endpoints): the entry point is
:func:`mqdedup.cli.main.main`, the grammar :mod:`mqdedup.cli.parser`, and each
sub-command lives, with the work it does, in its own module."""
