"""What a worker process of ``manage.py mqdedup_worker`` runs (spawned by the supervisor).

The same as ``mqdedup worker``'s children (:mod:`mqdedup.cli.runners`), with Django set
up first and the consumer run on Django's connection (:func:`mqdedup.django.sessions`).
"""

from __future__ import annotations

import django  # type: ignore[import-untyped]

from mqdedup.cli.config import use_table_prefix
from mqdedup.cli.loading import create_consumer
from mqdedup.cli.runners import _export_environment
from mqdedup.cli.supervisor import ChildSpec, MetricsHolder
from mqdedup.gc_tuning import tune_gc
from mqdedup.stopping import StopToken


def run_consumer(spec: ChildSpec, stop: StopToken, metrics: MetricsHolder) -> None:
    """Set up Django (``DJANGO_SETTINGS_MODULE`` is inherited), then consume until
    the stop token is set."""
    django.setup()
    from mqdedup.django.connection import sessions  # needs the apps loaded

    _export_environment(spec.options)
    consumer = create_consumer(spec.options["consumer"])
    consumer.validate()
    if not consumer.dedup.needs_database:
        tune_gc()
        consumer.run(None, stop=stop, metrics=metrics.source)
        return
    use_table_prefix(consumer, spec.options["table_prefix"])
    factory = sessions()
    tune_gc()
    consumer.run(factory, stop=stop, metrics=metrics.source)
