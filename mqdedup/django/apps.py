"""The Django app: add ``"mqdedup.django"`` to ``INSTALLED_APPS``."""

from __future__ import annotations

from django.apps import AppConfig  # type: ignore[import-untyped]


class MqdedupConfig(AppConfig):  # type: ignore[misc]
    """mqdedup's tables (as this app's migrations) and its management commands."""

    name = "mqdedup.django"
    label = "mqdedup"
    verbose_name = "mqdedup"
    default_auto_field = "django.db.models.BigAutoField"
