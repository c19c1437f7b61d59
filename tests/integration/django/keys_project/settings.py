"""Settings of the Django project the HTTP key tests serve with ``runserver``.

``KEYS_DATABASE_URL``: a SQLAlchemy URL of PostgreSQL (psycopg) or MariaDB (PyMySQL);
``KEYS_PREFIX``: mqdedup's table prefix (the tables and ``<prefix>effects`` are created
by the test). Authentication is a stand-in: ``X-User: <id>`` makes ``request.user`` a
(unsaved) ``User`` with that primary key, as a real authentication middleware would.
"""

import os
from urllib.parse import unquote, urlsplit

SECRET_KEY = "keys-tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
ROOT_URLCONF = "tests.integration.django.keys_project.urls"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "mqdedup.django"]
MIDDLEWARE = [
    "django.middleware.csrf.CsrfViewMiddleware",
    "tests.integration.django.keys_project.views.HeaderUser",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "OPTIONS": {
            "loaders": [
                ("django.template.loaders.locmem.Loader", {"order.html": "<p>order {{ n }}</p>"})
            ]
        },
    }
]
LOGGING = {
    "version": 1,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django.request": {"handlers": ["console"], "level": "ERROR"}},
}


def _database(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    common = {
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": parts.port or "",
    }
    if parts.scheme.startswith(("mysql", "mariadb")):
        import pymysql

        pymysql.install_as_MySQLdb()
        return {"ENGINE": "django.db.backends.mysql", **common, "OPTIONS": {"charset": "utf8mb4"}}
    return {"ENGINE": "django.db.backends.postgresql", **common}


DATABASES = {"default": _database(os.environ["KEYS_DATABASE_URL"])}
PREFIX = os.environ["KEYS_PREFIX"]
MQDEDUP = {"DATABASE": "default", "TABLE_PREFIX": PREFIX}
