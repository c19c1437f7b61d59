"""pytest-django with mqdedup's test kit (run with ``--ds=orders_project.settings``)."""

from mqdedup.django.testing import mqdedup_django_harness

__all__ = ["mqdedup_django_harness"]
