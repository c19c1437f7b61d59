"""The rush: ``python -m examples.flash_sale.rush --buyers 200 [--strategy lock]``.

Each buyer opens the order form (a one-time token) and submits it for one unit; every
fifth buyer double-clicks (the same form submitted twice at once). Buyers run on
``--threads`` threads. Prints what the buyers were told.
"""

from __future__ import annotations

import argparse
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from examples import settings
from examples.flash_sale.shop import Answer, Shop
from mqdedup.locks import PostgresLock


def main() -> None:
    """Run the buyers; print the answers per kind."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buyers", type=int, default=200)
    parser.add_argument("--sku", default="tee")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--strategy", choices=("conditional", "lock"), default="conditional")
    args = parser.parse_args()
    engine = settings.engine()
    shop = Shop(engine, strategy=args.strategy)

    def buy(number: int) -> list[Answer]:
        user = f"user-{number}"
        form = shop.open_form(user)
        clicks = 2 if number % 5 == 0 else 1
        lock = None
        if args.strategy == "lock":
            lock = PostgresLock(
                engine, f"stock:{args.sku}", ttl=10, prefix=settings.mqdedup_prefix()
            )
        return [shop.place_order(user, form, args.sku, 1, lock) for _ in range(clicks)]

    with ThreadPoolExecutor(args.threads) as pool:
        answers = [answer for answers in pool.map(buy, range(args.buyers)) for answer in answers]
    engine.dispose()
    told = Counter(str(answer.outcome) for answer in answers)
    print(f"{args.buyers} buyers ({args.strategy}): {dict(sorted(told.items()))}")


if __name__ == "__main__":
    main()
