"""Send the payments as Celery tasks: ``python -m examples.celery_claim.produce``.

``count`` tasks ``pay-0 …``, then ``resend`` of them again with the same ``task_id``
(a producer that retries), as :mod:`examples.faststream_claim.produce` does with headers.
"""

from __future__ import annotations

import argparse

from examples.celery_claim.tasks import app, charge


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--resend", type=int, default=5)
    args = parser.parse_args()
    ids = [f"pay-{n}" for n in range(args.count)] + [f"pay-{n}" for n in range(args.resend)]
    with app.producer_or_acquire() as producer:
        for task_id in ids:
            charge.apply_async(
                args=[10 + int(task_id.split("-")[1])], task_id=task_id, producer=producer
            )
    print(f"sent {len(ids)} tasks ({args.count} payments, {args.resend} resent)")


if __name__ == "__main__":
    main()
