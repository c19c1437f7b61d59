"""Settings of the django_orders example: everything that varies comes from the environment.

* ``ORDERS_DATABASE_URL``: ``postgresql://user:password@host:port/name`` or
  ``mysql://...`` (MariaDB/MySQL through PyMySQL; default: a SQLite file next to
  manage.py);
* ``ORDERS_CONN_MAX_AGE``: seconds a connection is kept (default 600; ``none``: forever);
* ``ORDERS_TABLE_PREFIX``: mqdedup's table prefix (default ``mqdedup_``);
* ``ORDERS_TOPIC`` / ``ORDERS_QUEUE``: where the ``order-placed`` events go and where the
  shipment consumers read them (Kafka topic / RabbitMQ queue); ``SHIPMENTS_TOPIC``:
  where the consumers' ``shipment-created`` events go (Kafka).
"""

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("ORDERS_SECRET_KEY", "django-insecure-example-only")
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
ROOT_URLCONF = "orders_project.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",  # the API's users: each one's Idempotency-Keys are its own
    "mqdedup.django",
    "orders",
]
MIDDLEWARE = ["orders.auth.BearerTokenMiddleware"]


def _database(url: str | None) -> dict[str, object]:
    if not url:
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": str(BASE_DIR / "orders.db")}
    parts = urlsplit(url)
    if parts.scheme.startswith(("mysql", "mariadb")):
        import pymysql  # Django's mysql backend through PyMySQL (what mqdedup.django speaks)

        pymysql.install_as_MySQLdb()
        return {
            "ENGINE": "django.db.backends.mysql",
            "NAME": parts.path.lstrip("/"),
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": parts.port or "",
            "OPTIONS": {"charset": "utf8mb4"},  # Django's default utf8 is 3 bytes a char
        }
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": parts.port or "",
        # Visible in pg_stat_activity (the tests find the workers' connections by it).
        "OPTIONS": {"application_name": os.environ.get("ORDERS_APP_NAME", "django_orders")},
    }


_max_age = os.environ.get("ORDERS_CONN_MAX_AGE", "600")
DATABASES = {
    "default": {
        **_database(os.environ.get("ORDERS_DATABASE_URL")),
        "CONN_MAX_AGE": None if _max_age.lower() == "none" else int(_max_age),
        "CONN_HEALTH_CHECKS": True,
    }
}

MQDEDUP = {"DATABASE": "default", "TABLE_PREFIX": os.environ.get("ORDERS_TABLE_PREFIX", "mqdedup_")}

ORDERS_TOPIC = os.environ.get("ORDERS_TOPIC", "order-placed")
ORDERS_QUEUE = os.environ.get("ORDERS_QUEUE", "order-placed")
SHIPMENTS_TOPIC = os.environ.get("SHIPMENTS_TOPIC", "shipments")
