"""Dead-lettering a batch's failed messages, and parking the ones the broker refuses."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.report import BatchAbandonedError, BatchReport
from mqdedup.consumers.transport import DeadLetter, Delivery, Transport
from mqdedup.dedup.dead_letters import DeadLetterCause, DeadLetterTable
from mqdedup.dedup.store import clean_text
from mqdedup.errors import DeadLetterRefusedError, MessageError

if TYPE_CHECKING:
    from mqdedup.consumers.metrics import Metrics
    from mqdedup.consumers.spec import ConsumerSpec
    from mqdedup.outages import Outages

log = logging.getLogger(__name__)


class DeadLettering:
    """Builds dead-letter records and hands them to the transport.

    A dead letter the broker refuses for good (:class:`DeadLetterRefusedError`) is
    *parked* in the database's dead-letter table instead, then settled like the others:
    one record the broker will never take must not hold up what comes after it. A
    consumer without a database (claims in Redis) cannot park: the refused message stays
    unsettled and an error line says so.
    """

    def __init__(
        self,
        consumer: ConsumerSpec,
        transport: Transport[Any],
        metrics: Metrics,
        sessions: sessionmaker[Session] | None,
        database_outages: Outages,
    ) -> None:
        self.name = consumer.consumer_name
        self.transport = transport
        self.metrics = metrics
        self.sessions = sessions
        self.database_outages = database_outages
        self.table = DeadLetterTable(consumer.table_prefix)

    def record(self, error: Exception, attempts: int) -> DeadLetter:
        """The dead letter of a message that failed ``attempts`` times with ``error``."""
        if isinstance(error, MessageError):
            reason = error.reason
        else:
            reason = f"handler failed after {attempts} attempts: {type(error).__name__}: {error}"
        # Header-safe and storable: an error text may carry NUL or a lone surrogate.
        return DeadLetter(
            reason=clean_text(reason),
            consumer=self.name,
            attempts=attempts,
            error_class=f"{type(error).__module__}.{type(error).__qualname__}",
            error_message=clean_text(str(error)),
        )

    def send(self, report: BatchReport) -> None:
        """Store dead letters durably; one that cannot be stored stays unsettled."""
        metrics = self.metrics
        kept: list[tuple[Delivery[Any], DeadLetter]] = []
        for delivery, record in report.dead_lettered:
            extra = {
                "consumer": self.name,
                "message_id": delivery.message.id,
                "coordinates": delivery.message.coordinates,
            }
            try:
                self.transport.dead_letter(delivery, record)
            except DeadLetterRefusedError as refusal:
                metrics.dead_letter_failures += 1
                if not self._park(delivery, record, refusal):
                    report.unsettled.append(delivery)
                    continue
                metrics.dead_letters_parked += 1
                log.error(
                    "the broker refused the dead letter; kept in the dead-letter table",
                    extra={**extra, "reason": record.reason, "refusal": str(refusal)},
                )
            except Exception:
                metrics.dead_letter_failures += 1
                log.exception("dead-letter failed; the message stays unsettled", extra=extra)
                report.unsettled.append(delivery)
                continue
            else:
                log.warning(
                    "dead-lettered",
                    extra={**extra, "reason": record.reason, "attempts": record.attempts},
                )
            kept.append((delivery, record))
        report.dead_lettered = kept

    def _park(self, delivery: Delivery[Any], record: DeadLetter, refusal: Exception) -> bool:
        """Keep a refused dead letter in the database; False if that failed too."""
        sessions = self.sessions
        extra = {"consumer": self.name, "coordinates": delivery.message.coordinates}
        if sessions is None:
            log.error(
                "the broker refused the dead letter and this consumer has no database to "
                "keep it in (its claims live in Redis); the message stays unsettled",
                extra={**extra, "reason": record.reason, "refusal": str(refusal)},
            )
            return False
        cause = DeadLetterCause(
            reason=record.reason,
            attempts=record.attempts,
            refusal=str(refusal),
            error_class=record.error_class,
            error_message=record.error_message,
        )

        def park() -> None:
            with sessions() as session, session.begin():
                self.table.park(session, self.name, delivery.message, cause)

        try:
            self.database_outages.run(park)
        except BatchAbandonedError:
            return False  # stopping while the database is down: the broker keeps it
        except Exception:
            log.exception(
                "could not keep the refused dead letter in the database either; the "
                "message stays unsettled",
                extra=extra,
            )
            return False
        return True
