"""Run the Celery worker: ``python -m examples.celery_claim.worker``.

The same as ``celery -A examples.celery_claim.tasks worker --pool solo``: one process, so
the crash point kills the worker itself, as ``kill -9`` would.
"""

from __future__ import annotations

from examples.celery_claim.tasks import app


def main() -> None:
    app.worker_main(
        [
            "worker",
            "--pool",
            "solo",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )


if __name__ == "__main__":
    main()
