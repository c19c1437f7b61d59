"""The console's pages and actions: Overview, Dead letters, Claims, Outbox, Audit, sign-in.

Each function takes the settings and the request's :class:`~mqdedup.console.web.Context`
and returns a :class:`~mqdedup.console.web.Response`. GET pages only read; an action is
offered as a link to its confirmation page (a GET saying what will happen), whose form
POSTs it with the session's CSRF token; the POST runs it, writes the audit row and shows
what happened.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from mqdedup.console import data
from mqdedup.console.chart import line_chart, minutes
from mqdedup.console.deadletters import ACTIONS, DeadLetterService, PlaceState
from mqdedup.console.html import (
    Html,
    age,
    as_json,
    join,
    link,
    mask_headers,
    post_form,
    show_body,
    table,
    tag,
    url,
    when,
)
from mqdedup.console.metrics import MetricsSampler
from mqdedup.console.security import Sessions, cookie_header, csrf_ok
from mqdedup.console.web import (
    ConsoleSettings,
    Context,
    ForbiddenError,
    Response,
    document,
    record,
    redirect,
)
from mqdedup.dedup.forgetting import forget_claim
from mqdedup.dedup.store import utcnow
from mqdedup.masking import mask_text

# -- sign-in ---------------------------------------------------------------------------------


def login_form(
    settings: ConsoleSettings, context: Context, *, status: int = 200, error: str = ""
) -> Response:
    """The token form (a console started with ``--token``)."""
    form = tag(
        "form",
        tag("input", type="hidden", name="csrf", value=context.session.csrf),
        tag("label", "Access token ", tag("input", type="password", name="token", autofocus=True)),
        " ",
        tag("button", "Sign in", type="submit", class_="primary"),
        method="post",
        action="/login",
    )
    message = tag("p", error, class_="error") if error else Html("")
    return document(settings, status, "Sign in", join([message, form]))


def login(settings: ConsoleSettings, sessions: Sessions, context: Context) -> Response:
    """GET: the form; POST: check the token, then a fresh signed-in session."""
    request = context.request
    if request.method != "POST":
        if context.actor is not None:
            return redirect("/")
        response = login_form(settings, context)
        response.headers["Set-Cookie"] = cookie_header(
            context.session, secure=settings.secure_cookie
        )
        return response
    if not csrf_ok(context.session, request.arg("csrf")):
        raise ForbiddenError("the sign-in form's CSRF token is missing or stale: reload the page")
    if not settings.access.check_token(request.arg("token")):
        return login_form(settings, context, status=403, error="wrong token")
    fresh = sessions.rotate(context.session, "token")
    response = redirect("/")
    response.headers["Set-Cookie"] = cookie_header(fresh, secure=settings.secure_cookie)
    return response


# -- overview --------------------------------------------------------------------------------


def overview(settings: ConsoleSettings, context: Context) -> Response:
    """Throughput per consumer, dead letters, lag, last commit, the outbox and relays."""
    engine, prefix = settings.engine, settings.prefix
    now = utcnow()
    since = data.window_start(settings.hours)
    per_minute = data.processed_per_minute(engine, prefix, since)
    last = data.last_commits(engine, prefix)
    names = sorted(set(per_minute) | set(last) | {c.consumer_name for c in settings.consumers})
    axis = minutes(since, now)
    sampler: MetricsSampler | None = settings.metrics
    duplicates = sampler.per_minute() if sampler is not None else {}
    names = sorted(set(names) | set(duplicates))
    title = f"Processed per minute, last {settings.hours:g} h"
    if sampler is not None:
        title = f"Processed and duplicates per minute, last {settings.hours:g} h"
    parts: list[Html] = [tag("h2", title)]
    if sampler is None:
        parts.append(
            tag(
                "p",
                "Duplicates per minute: start the console with --metrics URL (the workers' "
                "/metrics) to chart them; no table records a duplicate.",
                class_="note",
            )
        )
    elif sampler.error:
        parts.append(tag("p", f"metrics unreadable: {sampler.error}", class_="error"))
    if not names:
        parts.append(tag("p", "no claims yet", class_="empty"))
    for name in names:
        counts = per_minute.get(name, {})
        series = {"processed": counts}
        caption = f"{name}: {sum(counts.values())} processed"
        if sampler is not None:
            series["duplicates"] = duplicates.get(name, {})
            caption += (
                f", {sum(series['duplicates'].values())} duplicates (since the console started)"
            )
        parts.append(line_chart(axis, series, title=caption))
    parts.append(tag("h2", "Consumers"))
    parts.append(
        table(
            ["consumer", f"processed ({settings.hours:g} h)", "last commit", "age of last commit"],
            [
                (
                    name,
                    sum(per_minute.get(name, {}).values()),
                    when(last.get(name)),
                    age((now - last[name]).total_seconds()) if name in last else "-",
                )
                for name in names
            ],
        )
    )
    parts.append(tag("h2", "Lag (Kafka partitions) / queue depth (RabbitMQ)"))
    parts.append(_lag_table(settings))
    parts.append(tag("h2", "Dead letters"))
    parts.append(_dead_letter_depths(settings))
    parts.append(tag("h2", "Outbox"))
    parts.append(_outbox_summary(settings, now))
    return document(settings, 200, "Overview", join(parts), current="/")


def _lag_table(settings: ConsoleSettings) -> Html:
    if not settings.consumers or settings.lags is None:
        return tag(
            "p", "start the console with consumer classes (MODULE:CLASS) to see lag", class_="empty"
        )
    entries = settings.lags(settings.consumers)
    return table(
        ["consumer", "partition / queue", "lag"],
        [
            (
                e["consumer"],
                e["where"] or "-",
                e["lag"] if e["error"] is None else mask_text(e["error"]),
            )
            for e in entries
        ],
    )


def _dead_letter_depths(settings: ConsoleSettings) -> Html:
    service: DeadLetterService | None = settings.dead_letters
    if service is None:
        return tag("p", "no dead-letter places configured", class_="empty")
    rows: list[tuple[Any, ...]] = []
    for place in service.places:
        try:
            rows.append((place.place, place.depth()))
        except Exception as exc:
            rows.append((place.place, mask_text(f"cannot read: {exc}".splitlines()[0])))
    return join([table(["place", "dead letters"], rows), link("see them", "/dead-letters")])


def _outbox_summary(settings: ConsoleSettings, now: datetime) -> Html:
    status = data.outbox_status(settings.engine, settings.prefix)
    leases = data.relay_leases(settings.engine, settings.prefix)
    summary = table(
        ["pending (backlog)", "oldest unpublished", "failed", "published"],
        [(status.pending, age(status.oldest_pending_age), status.failed, status.published)],
    )
    per_destination = table(
        ["broker", "destination", "pending", "failed", "published", "oldest due"],
        [
            (
                d.broker,
                d.destination or "(default exchange)",
                d.pending,
                d.failed,
                d.published,
                age(d.oldest_pending_age),
            )
            for d in status.destinations
        ],
    )
    lease_rows = table(
        ["relay", "shards", "lease ends in"],
        [
            (lease.relay_id, lease.shards, age((lease.locked_until - now).total_seconds()))
            for lease in leases
        ],
    )
    return join(
        [
            summary,
            tag("h3", "Per destination"),
            per_destination,
            tag("h3", "Relay leases"),
            lease_rows,
        ]
    )


# -- claims ----------------------------------------------------------------------------------


def claims(settings: ConsoleSettings, context: Context) -> Response:
    """Look up one message id of one consumer: claim, stored result, attempts, steps."""
    consumer = context.request.arg("consumer")
    message_id = context.request.arg("id")
    known = data.consumer_names(settings.engine, settings.prefix)
    options = [tag("option", name, value=name, selected=name == consumer) for name in known]
    form = tag(
        "form",
        tag(
            "label",
            "Consumer ",
            tag("input", type="text", name="consumer", value=consumer, list="consumers"),
        ),
        tag("datalist", *options, id="consumers"),
        " ",
        tag("label", "Message id ", tag("input", type="text", name="id", value=message_id)),
        " ",
        tag("button", "Look up", type="submit", class_="primary"),
        method="get",
        action="/claims",
    )
    parts: list[Html] = [form]
    if consumer and message_id:
        claim = data.find_claim(settings.engine, settings.prefix, consumer, message_id)
        parts.append(_claim_details(settings, claim))
    return document(settings, 200, "Claims", join(parts), current="/claims")


def _claim_details(settings: ConsoleSettings, claim: data.Claim) -> Html:
    if not claim.found:
        return tag(
            "p", f"no claim for message id {claim.message_id!r} of {claim.consumer}", class_="empty"
        )
    facts = table(
        ["consumer", "message id", "processed at", "attempts", "last error"],
        [
            (
                claim.consumer,
                claim.message_id,
                when(claim.processed_at),
                "-" if claim.attempts is None else claim.attempts,
                claim.last_error or "-",
            )
        ],
    )
    result = tag("pre", as_json(claim.result), class_="body") if claim.processed_at else Html("")
    steps = table(
        ["step", "state", "attempts", "result", "started", "completed"],
        [
            (
                s["name"],
                s["state"],
                s["attempts"],
                as_json(s["result"]),
                when(s["started_at"]),
                when(s["completed_at"]),
            )
            for s in claim.steps
        ],
    )
    parts = [
        facts,
        tag("h2", "Stored result"),
        result or tag("p", "none", class_="empty"),
        tag("h2", "Steps"),
        steps,
    ]
    if settings.read_only is False and claim.processed_at is not None:
        parts.append(
            tag(
                "a",
                "Forget this claim…",
                class_="button",
                href=url("/claims/forget", consumer=claim.consumer, id=claim.message_id),
            )
        )
    return join(parts)


def confirm_forget(settings: ConsoleSettings, context: Context) -> Response:
    """What forgetting a claim does, and the form that does it."""
    consumer = context.request.arg("consumer")
    message_id = context.request.arg("id")
    text = (
        f"Forget the claim of message id {message_id!r} for consumer {consumer!r}: the next "
        "delivery or replay of this message runs its handler again (its effects can happen a "
        "second time), and the calls of its recorded steps are made again too."
    )
    body = join(
        [
            tag("p", text),
            _confirm_form(
                settings,
                context,
                "/claims/forget",
                "Forget the claim",
                {"consumer": consumer, "id": message_id},
                danger=True,
            ),
        ]
    )
    return document(
        settings, 200, "Forget a claim?", tag("div", body, class_="confirm"), current="/claims"
    )


def forget(settings: ConsoleSettings, context: Context) -> Response:
    """POST: forget the claim; audit it."""
    consumer = context.request.arg("consumer")
    message_id = context.request.arg("id")
    removed = forget_claim(settings.engine, settings.prefix, consumer, message_id)["claims"]
    outcome = f"forgot {removed} claim(s)"
    record(settings, context, "forget-claim", f"{consumer}/{message_id}", removed, outcome)
    return _done(
        settings, context, outcome, url("/claims", consumer=consumer, id=message_id), "/claims"
    )


# -- outbox ----------------------------------------------------------------------------------


def outbox(settings: ConsoleSettings, context: Context) -> Response:
    """Failed outbox rows with their errors; retry one or all."""
    rows = data.failed_outbox_rows(settings.engine, settings.prefix)
    actions = settings.read_only is False
    body_rows = [
        (
            r.id,
            r.message_id,
            r.broker,
            r.destination or "(default exchange)",
            r.attempts,
            tag("pre", r.last_error),
            when(r.created_at),
            tag("a", "Retry…", class_="button", href=url("/outbox/retry", id=r.id))
            if actions
            else "",
        )
        for r in rows
    ]
    parts = [
        table(
            ["id", "message id", "broker", "destination", "attempts", "error", "created", ""],
            body_rows,
        )
    ]
    if rows and actions:
        parts.append(
            tag("a", f"Retry all {len(rows)} failed rows…", class_="button", href="/outbox/retry")
        )
    return document(settings, 200, "Outbox: failed rows", join(parts), current="/outbox")


def confirm_retry(settings: ConsoleSettings, context: Context) -> Response:
    """What a retry does."""
    ids = context.request.args("id")
    scope = f"row {', '.join(ids)}" if ids else "every failed row"
    text = (
        f"Put {scope} back to pending with fresh attempts: the relay publishes it again "
        "(with the same message id, so consumers' claims skip a copy already processed)."
    )
    form = _confirm_form(settings, context, "/outbox/retry", "Retry", {"id": ids})
    return document(
        settings,
        200,
        "Retry failed outbox rows?",
        tag("div", join([tag("p", text), form]), class_="confirm"),
        current="/outbox",
    )


def retry(settings: ConsoleSettings, context: Context) -> Response:
    """POST: retry failed rows; audit it."""
    raw = context.request.args("id")
    try:
        ids = [int(value) for value in raw] or None
    except ValueError:
        raise ForbiddenError("outbox row ids are numbers") from None
    count = data.retry_outbox(settings.engine, settings.prefix, ids)
    outcome = f"put {count} failed outbox row(s) back to pending"
    record(settings, context, "retry-outbox", ",".join(raw) or "all failed", count, outcome)
    return _done(settings, context, outcome, "/outbox", "/outbox")


# -- audit -----------------------------------------------------------------------------------


def audit_page(settings: ConsoleSettings, context: Context) -> Response:
    """The newest actions taken in the console."""
    entries = data.recent_audit(settings.engine, settings.prefix)
    rows = [(e.id, when(e.at), e.actor, e.action, e.target, e.messages, e.outcome) for e in entries]
    return document(
        settings,
        200,
        "Audit",
        table(["#", "when", "who", "what", "target", "messages", "outcome"], rows),
        current="/audit",
    )


# -- dead letters ----------------------------------------------------------------------------


def _service(settings: ConsoleSettings) -> DeadLetterService:
    if settings.dead_letters is None:
        raise ForbiddenError("no dead-letter places are configured")
    service: DeadLetterService = settings.dead_letters
    return service


def dead_letters(settings: ConsoleSettings, context: Context) -> Response:
    """Every place's dead letters grouped by consumer and error; one group's messages."""
    service = _service(settings)
    request = context.request
    if request.arg("place"):
        return _group_page(settings, context, service)
    parts: list[Html] = []
    for state in service.overview():
        parts.append(
            tag(
                "h2", f"{state.place}: {'?' if state.depth is None else state.depth} dead letter(s)"
            )
        )
        if state.error:
            parts.append(tag("p", state.error, class_="error"))
            continue
        parts.append(_groups_table(settings, state))
    return document(settings, 200, "Dead letters", join(parts), current="/dead-letters")


def _groups_table(settings: ConsoleSettings, state: PlaceState) -> Html:
    rows = []
    for group in state.groups:
        where = {"place": group.place, "consumer": group.consumer or "", "error": group.error}
        rows.append(
            (
                group.consumer or "-",
                group.error,
                len(group.records),
                when(group.oldest),
                join(
                    [
                        link("open", "/dead-letters", **where),
                        " ",
                        _action_links(settings, group.consumer, where),
                    ]
                ),
            )
        )
    return table(["consumer", "error", "messages", "oldest", ""], rows)


def _action_links(settings: ConsoleSettings, consumer: str | None, where: dict[str, str]) -> Html:
    if settings.read_only:
        return Html("")
    links = []
    for action in ACTIONS:
        if action == "requeue" and where.get("place") == "database":
            continue  # the broker refused these once: they are replayed, not requeued
        links.append(
            tag(
                "a",
                f"{action}…",
                class_="button",
                href=url("/dead-letters/confirm", action=action, **where),
            )
        )
    return join(links, " ")


def _group_page(
    settings: ConsoleSettings, context: Context, service: DeadLetterService
) -> Response:
    request = context.request
    place, consumer, error = request.arg("place"), request.arg("consumer"), request.arg("error")
    records = service.keys_of_group(place, consumer, error)
    rows = [
        (
            link(r.key, "/dead-letters/message", place=place, key=r.key),
            r.message_id or "-",
            r.source,
            "-" if r.attempts is None else r.attempts,
            f"{r.size:,} B",
            when(r.dead_lettered_at),
        )
        for r in records
    ]
    where = {"place": place, "consumer": consumer, "error": error}
    parts = [
        tag("p", f"{place} / {consumer or '-'}: ", tag("code", error)),
        _action_links(settings, consumer, where),
        table(["key", "message id", "source", "attempts", "body", "dead-lettered"], rows),
    ]
    return document(
        settings,
        200,
        f"Dead letters: {len(records)} in this group",
        join(parts),
        current="/dead-letters",
    )


def dead_letter(settings: ConsoleSettings, context: Context) -> Response:
    """One dead letter: headers (masked), body (escaped, limited), reason, attempts."""
    service = _service(settings)
    place, key = context.request.arg("place"), context.request.arg("key")
    letter = service.record(place, key)
    if letter is None:
        return document(
            settings,
            404,
            "Dead letter not found",
            tag("p", f"{place} holds no dead letter {key!r} (handled already?)", class_="empty"),
            current="/dead-letters",
        )
    facts = table(
        ["place", "key", "consumer", "message id", "source", "attempts", "dead-lettered", "size"],
        [
            (
                letter.place,
                letter.key,
                letter.consumer or "-",
                letter.message_id or "-",
                letter.source,
                "-" if letter.attempts is None else letter.attempts,
                when(letter.dead_lettered_at),
                f"{letter.size:,} bytes",
            )
        ],
    )
    where = {"place": place, "key": key, "consumer": letter.consumer or ""}
    parts = [
        facts,
        tag("h2", "Reason"),
        tag("pre", mask_text(letter.reason), class_="body"),
    ]
    if letter.refusal:
        parts += [
            tag("h2", "Why the broker refused it"),
            tag("pre", mask_text(letter.refusal), class_="body"),
        ]
    parts += [
        tag("h2", "Headers"),
        table(["name", "value"], mask_headers(letter.headers.items())),
        tag("h2", "Body"),
        show_body(letter.body, settings.body_limit),
        _action_links(settings, letter.consumer, where),
    ]
    return document(settings, 200, f"Dead letter {key}", join(parts), current="/dead-letters")


def _chosen(service: DeadLetterService, context: Context) -> tuple[str, list[str], str]:
    """The place, the keys and the consumer an action request names (one key or a group)."""
    request = context.request
    place = request.arg("place")
    keys = request.args("key")
    consumer = request.arg("consumer")
    if not keys and request.arg("error"):
        keys = [r.key for r in service.keys_of_group(place, consumer, request.arg("error"))]
    return place, keys, consumer


_WHAT = {
    "replay": (
        "Run {n} dead letter(s) of {place} through consumer {consumer} ({cls}). The claims "
        "decide: a message already processed is skipped as a duplicate, so each message's "
        "effects happen once even if this is run twice. Messages that succeed leave {place}; "
        "messages that fail again are dead-lettered again."
    ),
    "requeue": (
        "Send {n} dead letter(s) back to their source topic / queue with the same message ids "
        "and remove them from {place}. The running consumer processes them; its claims skip a "
        "message already processed."
    ),
    "delete": "Delete {n} dead letter(s) from {place} for good. This cannot be undone.",
}


def confirm_dead_letters(settings: ConsoleSettings, context: Context) -> Response:
    """What a replay / requeue / delete will do, with the keys it will act on."""
    service = _service(settings)
    action = context.request.arg("action")
    if action not in ACTIONS:
        raise ForbiddenError(f"unknown action {action!r}")
    place, keys, consumer = _chosen(service, context)
    target = settings_consumer(settings, consumer)
    text = _WHAT[action].format(
        n=len(keys),
        place=place,
        consumer=consumer or "-",
        cls=type(target).__module__ + ":" + type(target).__qualname__ if target else "-",
    )
    parts: list[Html] = [tag("p", text)]
    if action == "replay" and target is None:
        parts.append(
            tag(
                "p",
                f"No consumer class was given for {consumer or 'these messages'}: "
                "start the console with its MODULE:CLASS to replay them.",
                class_="error",
            )
        )
    elif keys:
        parts.append(
            _confirm_form(
                settings,
                context,
                "/dead-letters/act",
                f"{action.capitalize()} {len(keys)}",
                {"action": action, "place": place, "consumer": consumer, "key": keys},
                danger=action == "delete",
            )
        )
    parts.append(
        tag("details", tag("summary", f"the {len(keys)} key(s)"), tag("pre", "\n".join(keys)))
    )
    return document(
        settings,
        200,
        f"{action.capitalize()} dead letters?",
        tag("div", join(parts), class_="confirm"),
        current="/dead-letters",
    )


def act_on_dead_letters(settings: ConsoleSettings, context: Context) -> Response:
    """POST: replay / requeue / delete the confirmed keys; audit it."""
    service = _service(settings)
    action = context.request.arg("action")
    if action not in ACTIONS:
        raise ForbiddenError(f"unknown action {action!r}")
    place, keys, consumer = _chosen(service, context)
    target = settings_consumer(settings, consumer)
    if action == "replay" and target is None:
        raise ForbiddenError(f"no consumer class was given for {consumer!r}: nothing replayed")
    count, outcome = service.act(action, place, keys, target)
    record(
        settings,
        context,
        f"{action}-dead-letters",
        f"{place}:{consumer or '-'}:{len(keys)} key(s)",
        count,
        outcome,
    )
    return _done(settings, context, outcome, "/dead-letters", "/dead-letters")


def settings_consumer(settings: ConsoleSettings, name: str) -> Any:
    """The consumer instance given for ``name`` (None if not given)."""
    for consumer in settings.consumers:
        if consumer.consumer_name == name:
            return consumer
    return None


# -- shared ----------------------------------------------------------------------------------


def _confirm_form(
    settings: ConsoleSettings,
    context: Context,
    action: str,
    label: str,
    fields: dict[str, Any],
    *,
    danger: bool = False,
) -> Html:
    if settings.read_only:
        return tag("p", "read-only: no action", class_="empty")
    return join(
        [
            post_form(action, context.session.csrf, label, fields, danger=danger),
            " ",
            tag("a", "Cancel", href="/", class_="button"),
        ]
    )


def _done(
    settings: ConsoleSettings, context: Context, outcome: str, back: str, current: str
) -> Response:
    body = join([tag("p", outcome, class_="result"), link("back", back)])
    return document(settings, 200, "Done", body, current=current)
