"""Every shell command of README.md, CONTRIBUTING.md, the site's pages (docs/**/*.md), the
examples' READMEs and the services script's page (scripts/README-services.md) runs as
written.

Each fenced ``bash`` / ``sh`` / ``shell`` / ``console`` block is one test, named after
its file and line (``README.md:L28``), run in document order in its own
``bash -euo pipefail`` session from the repository root, with the environment a user
who followed the install steps and ``scripts/services.sh env`` would have: the venv's
``bin`` first on ``PATH`` and the service URLs. ``tests/acceptance/docs_blocks.py``
describes the ``<!-- docs-test: ... -->`` annotations (skip, background, exit N,
equivalent, fresh-checkout).

Isolation from the other tests running on the same services: ``MQDEDUP_DATABASE_URL``
(and ``MQDEDUP_TEST_DATABASE_URL``) point at a PostgreSQL database created for this
run and page and dropped afterwards, so the docs keep the default table prefix; the
examples' topic, group and queue variables get names unique to the run and the page. Blocks
that install packages run in a throw-away copy of the checkout with its own ``.venv``.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import make_url, text

from mqdedup.db import create_engine
from tests.acceptance.docs_blocks import Block, doc_files, parse, python_blocks
from tests.services import REPO, require_service

pytestmark = [pytest.mark.integration]

VENV_BIN = Path(sys.executable).parent
PARSED = {path: parse(path, REPO) for path in doc_files(REPO)}
BLOCKS: list[Block] = [block for blocks, _ in PARSED.values() for block in blocks]
#: Test order: the fresh-checkout blocks, which run in a thread of their own from the
#: first test on, are awaited last; each group keeps document order.
ORDERED = [b for b in BLOCKS if not b.directive("fresh-checkout")] + [
    b for b in BLOCKS if b.directive("fresh-checkout")
]
ANNOTATION_ERRORS: list[str] = [error for _, errors in PARSED.values() for error in errors]

#: Blocks that cannot run here, by (file, start of the first line): keep this list short.
ALLOWED_SKIPS: dict[tuple[str, str], str] = {
    ("README.md", "bash scripts/test.sh"): "the whole suite, this test included (recursion)",
    ("docs/benchmarks.md", ".venv/bin/python -m bench "): "the 8-minute full run",
    ("docs/replay.md", "mqdedup replay shop.consumers:PaymentStream"): "a RabbitMQ stream",
    ("examples/README.md", "docker compose up"): "no Docker here",
    ("docs/tools.md", "mqdedup worker myapp.sms:SendSms"): (
        "an illustration; tests/acceptance/test_cli_redis_worker.py runs a RedisDedup consumer so"
    ),
    ("scripts/README-services.md", "docker compose up"): "no Docker here",
    ("examples/flash_sale/README.md", "python -m examples.flash_sale.gateway"): (
        "a server until Ctrl-C; tests/acceptance/test_example_flash_sale.py runs it"
    ),
    ("examples/flash_sale/README.md", "mqdedup worker examples.flash_sale.consumer"): (
        "needs that server; tests/acceptance/test_example_flash_sale.py runs it end to end"
    ),
}
#: At least this many blocks must really run (guards against a parser that finds nothing).
MIN_EXECUTED = 15
BLOCK_TIMEOUT = 300.0
DAEMON_TIMEOUT = 90.0
STOP_TIMEOUT = 60.0
#: The fresh-checkout blocks run one after the other; the last waits for all before it.
CHECKOUT_TIMEOUT = 600.0


@dataclass(frozen=True)
class DocsEnv:
    """The environment of the run: service URLs, a database per page, unique names."""

    base: dict[str, str]
    tag: str
    databases: dict[str, str]  # page -> URL of its own PostgreSQL database

    def for_page(self, relative: str) -> dict[str, str]:
        """The env for one page's blocks: its database, the examples' names unique to it.

        Pages are independent, like two readers: the guide's orders do not meet the
        order-service example's in one ``example_orders`` table.
        """
        slug = re.sub(r"[^a-z0-9]+", "-", relative.lower()).strip("-")[:24]
        name = f"docs-{self.tag}-{slug}"
        url = self.databases[relative]
        return {
            **self.base,
            "MQDEDUP_DATABASE_URL": url,
            "MQDEDUP_TEST_DATABASE_URL": url,
            "ORDERS_TOPIC": f"{name}-orders",
            "ORDER_EVENTS_TOPIC": f"{name}-order-events",
            "ORDERS_GROUP": f"{name}-order-service",
            "PAYMENTS_QUEUE": f"{name}-payments",
            "API_ORDER_EVENTS_TOPIC": f"{name}-api-order-events",
            "API_SHIPPING_GROUP": f"{name}-api-shipping",
            "FLASH_SALE_QUEUE": f"{name}-flash-sale-orders",
            "FLASH_SALE_EVENTS_QUEUE": f"{name}-flash-sale-events",
            "CLAIM_TOPIC": f"{name}-claim-payments",
            "CLAIM_QUEUE": f"{name}-claim-payments",
            "CLAIM_GROUP": f"{name}-claim-payments",
        }


def _services_env() -> dict[str, str]:
    """``os.environ`` plus what ``eval "$(bash scripts/services.sh env)"`` exports."""
    result = subprocess.run(
        ["bash", "-c", 'eval "$(bash scripts/services.sh env)" && env -0'],
        cwd=REPO,
        capture_output=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        require_service("services", f"scripts/services.sh env failed: {result.stderr!r}")
    pairs = (item.partition(b"=") for item in result.stdout.split(b"\0") if item)
    return {key.decode(): value.decode() for key, _, value in pairs}


@pytest.fixture(scope="module")
def docs_env() -> Iterator[DocsEnv]:
    """Service URLs with PostgreSQL databases of this run's own (one per page); cleaned up."""
    env = _services_env()
    for variable, service in (
        ("MQDEDUP_TEST_DATABASE_URL", "PostgreSQL"),
        ("MQDEDUP_KAFKA_BOOTSTRAP", "Kafka"),
        ("MQDEDUP_RABBITMQ_URL", "RabbitMQ"),
    ):
        if not env.get(variable):
            require_service(service, f"{variable} is not set")
    tag = uuid.uuid4().hex[:8]
    pages = sorted({b.relative for b in BLOCKS})
    names = {page: f"mqdedup_docs_{tag}_{n}" for n, page in enumerate(pages)}
    shared_url = env["MQDEDUP_TEST_DATABASE_URL"]
    admin = create_engine(shared_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            for database in names.values():
                connection.execute(text(f'CREATE DATABASE "{database}"'))
    except Exception as error:  # any failure means PostgreSQL is unusable here
        admin.dispose()
        require_service("PostgreSQL", f"cannot create a database: {error}")
    databases = {
        page: make_url(shared_url).set(database=name).render_as_string(hide_password=False)
        for page, name in names.items()
    }
    for name in ("MQDEDUP_CONFIG", "MQDEDUP_TABLE_PREFIX", "VIRTUAL_ENV"):
        env.pop(name, None)
    scratch = tempfile.mkdtemp(prefix="mqdedup-docs-tmp-")  # e.g. bench --quick results
    env.update(
        {
            "TMPDIR": scratch,
            "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
        }
    )
    docs = DocsEnv(env, tag, databases)
    try:
        yield docs
    finally:
        with admin.connect() as connection:
            for database in names.values():
                connection.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()
        _delete_broker_names(docs)
        shutil.rmtree(scratch, ignore_errors=True)


def _delete_broker_names(docs: DocsEnv) -> None:
    """Delete the topics and queues this run created (all named ``docs-<tag>-...``)."""
    import kafka
    import pika

    env, prefix = docs.base, f"docs-{docs.tag}-"
    admin = kafka.KafkaAdminClient(bootstrap_servers=env["MQDEDUP_KAFKA_BOOTSTRAP"])
    try:
        doomed = [topic for topic in admin.list_topics() if topic.startswith(prefix)]
        if doomed:
            admin.delete_topics(doomed)
    finally:
        admin.close()
    pages = {block.relative for block in BLOCKS}
    connection = pika.BlockingConnection(pika.URLParameters(env["MQDEDUP_RABBITMQ_URL"]))
    try:
        channel = connection.channel()
        for page in pages:
            names = docs.for_page(page)
            queue = names["PAYMENTS_QUEUE"]
            for name in (queue, f"{queue}.dlq", names["CLAIM_QUEUE"]):
                channel.queue_delete(name)
    finally:
        connection.close()


def make_checkout(root: Path) -> Path:
    """A copy of the working tree (tracked and new files) with an empty ``.venv``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    subprocess.run(
        ["python3", "-m", "venv", ".venv"],
        cwd=root,
        env=_checkout_env(os.environ.copy(), root),
        check=True,
        timeout=180,
    )
    return root


@pytest.fixture(scope="module")
def checkout_runs(
    docs_env: DocsEnv, request: pytest.FixtureRequest
) -> Iterator[dict[str, Future[str]]]:
    """The selected fresh-checkout blocks, run in document order in one throw-away checkout.

    They install packages (tens of seconds each), so they run in a thread of their own
    while the other blocks run; each block's test waits for its own result.
    """
    selected = {
        item.callspec.params["block"].ident
        for item in request.session.items
        if hasattr(item, "callspec") and isinstance(item.callspec.params.get("block"), Block)
    }
    blocks = [
        b
        for b in BLOCKS
        if b.directive("fresh-checkout") and not _skipped(b) and b.ident in selected
    ]
    if not blocks:
        yield {}
        return
    root = Path(tempfile.mkdtemp(prefix="mqdedup-docs-checkout-"))
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="docs-checkout")
    made = executor.submit(make_checkout, root)

    def run(block: Block) -> str:
        made.result()
        env = _checkout_env(docs_env.for_page(block.relative), root)
        return run_foreground(block, env, root)

    futures = {block.ident: executor.submit(run, block) for block in blocks}
    try:
        yield futures
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(root, ignore_errors=True)


def _checkout_env(env: dict[str, str], root: Path) -> dict[str, str]:
    """``env`` with the checkout's own venv first and the project's venv off ``PATH``."""
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != VENV_BIN]
    return {
        **env,
        "PATH": os.pathsep.join([str(root / ".venv" / "bin"), *path]),
        "VIRTUAL_ENV": str(root / ".venv"),
        "PYTHONPATH": str(root),
    }


def _bash(script: str) -> list[str]:
    return ["bash", "--noprofile", "--norc", "-euo", "pipefail", "-c", script]


def _leftovers(group: int) -> bool:
    """Whether a process of ``group`` (a block's own session) is still running.

    Zombies do not count: this machine's init does not always reap orphans at once.
    """
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        state, pgid = fields[0], int(fields[2])
        if pgid == group and state != "Z":
            return True
    return False


def run_foreground(block: Block, env: dict[str, str], cwd: Path) -> str:
    """Run the block; check its exit status (and a console block's output); return output."""
    steps = block.console_steps() if block.language == "console" else []
    if steps and not block.directive("equivalent"):
        script = "".join(
            # The step's status is its whole command line's (``a && b`` included).
            f"printf '\\n@@docs-test step {n}@@\\n'\n{{ {command}\n}} || exit $?\n"
            for n, (command, _) in enumerate(steps)
        )
    else:
        script = block.script()
    # Output to a file, not a pipe: a process the block leaves behind would hold a pipe
    # open, and the block is over when its shell exits.
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(
            _bash(script),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            process.wait(timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            output.seek(0)
            raise AssertionError(
                f"{block.ident} did not finish within {BLOCK_TIMEOUT:.0f}s:\n"
                f"{output.read().decode(errors='replace')[-4000:]}"
            ) from None
        output.seek(0)
        printed = output.read().decode(errors="replace")
    left_running = _leftovers(process.pid)
    if left_running:
        os.killpg(process.pid, signal.SIGKILL)
    exit_directive = block.directive("exit")
    expected = int(exit_directive.argument) if exit_directive else 0
    assert process.returncode == expected, (
        f"{block.ident} exited {process.returncode}, expected {expected}:\n{script}\n"
        f"--- output ---\n{printed[-6000:]}"
    )
    assert not left_running, (
        f"{block.ident} left processes running (a daemon belongs in its own block with "
        "<!-- docs-test: background -->)"
    )
    if steps and not block.directive("equivalent"):
        check_console_output(block, steps, printed)
    return printed


def _normal(line: str) -> str:
    return " ".join(line.split())


def check_console_output(block: Block, steps: list[tuple[str, list[str]]], printed: str) -> None:
    """Each expected line of a console step appears in that step's output."""
    outputs = re.split(r"^@@docs-test step \d+@@$", printed, flags=re.M)[1:]
    for (command, expected), output in zip(steps, outputs, strict=True):
        got = [_normal(line) for line in output.splitlines() if line.strip()]
        for line in expected:
            pattern = ".*".join(re.escape(part) for part in _normal(line).split("..."))
            assert any(re.fullmatch(pattern, g) for g in got), (
                f"{block.ident}: `{command}` did not print {line.strip()!r}; it printed:\n"
                + "\n".join(got)
            )


def _metrics(port: int) -> dict[str, float] | None:
    """``/metrics`` summed per metric name; None while the endpoint does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            body = response.read().decode()
    except (OSError, urllib.error.URLError):
        return None
    totals: dict[str, float] = {}
    for line in body.splitlines():
        match = re.match(r"^([a-z_]+)(?:\{[^}]*\})? (\S+)$", line)
        if match:
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(2))
    return totals


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz/ready", timeout=5):
            return True
    except (OSError, urllib.error.URLError):
        return False


def _caught_up(now: dict[str, float], before: dict[str, float] | None, relay: bool) -> bool:
    """Started, nothing left and no counter moved since ``before``.

    Nothing left: a worker's Kafka lag is 0 and every delivery it fetched is finished
    (processed, duplicate or dead-lettered; not waiting for a retry); a relay's outbox
    backlog is 0.
    """
    lag = now.get("mqdedup_consumer_lag")
    backlog = now.get("mqdedup_outbox_backlog")
    delivered = now.get("mqdedup_messages_delivered_total", 0.0)
    finished = sum(
        now.get(f"mqdedup_messages_{name}_total", 0.0)
        for name in ("processed", "duplicates", "dead_lettered")
    )
    if relay:
        started, left = backlog is not None, bool(backlog)
    else:
        started, left = lag is not None or delivered > 0, bool(lag) or finished < delivered
    counters = {k: v for k, v in now.items() if _work_counter(k)}
    previous = {k: v for k, v in (before or {}).items() if _work_counter(k)}
    return started and not left and before is not None and counters == previous


def _work_counter(name: str) -> bool:
    """A counter of work done (not of CPU time, which grows while idle)."""
    return name.endswith("_total") and name.startswith("mqdedup_") and "_process_" not in name


def run_background(block: Block, env: dict[str, str], cwd: Path, log: Path) -> None:
    """Start the daemon, wait until it is healthy and idle, SIGTERM it, expect exit 0."""
    command = block.script().strip()
    with log.open("wb") as output:
        process = subprocess.Popen(
            _bash(f"exec {command}"),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def failure(what: str) -> str:
        return f"{block.ident}: {what}:\n{log.read_text(errors='replace')[-5000:]}"

    try:
        port_match = re.search(r"--health-port[ =](\d+)", command)
        deadline = time.monotonic() + DAEMON_TIMEOUT
        if port_match:
            port = int(port_match.group(1))
            while not _ready(port):
                assert process.poll() is None, failure(f"exited {process.returncode} early")
                assert time.monotonic() < deadline, failure("never became ready")
                time.sleep(0.2)
            before: dict[str, float] | None = None
            while True:
                assert process.poll() is None, failure(f"exited {process.returncode} early")
                now = _metrics(port) or {}
                if _caught_up(
                    now, before, relay=re.search(r"\bmqdedup\s+relay\b", command) is not None
                ):
                    break
                assert time.monotonic() < deadline, failure(f"never caught up: {now}")
                before = now
                time.sleep(1.0)
        else:
            # No health endpoint: it must survive its start-up (connect, check tables).
            settled = time.monotonic() + 5.0
            while time.monotonic() < settled:
                assert process.poll() is None, failure(f"exited {process.returncode} early")
                time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(failure("did not stop within 60s of SIGTERM")) from None
        assert code == 0, failure(f"exited {code} after SIGTERM, expected 0")
    finally:
        if _leftovers(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def _skipped(block: Block) -> str | None:
    directive = block.directive("skip")
    return directive.argument if directive else None


@pytest.mark.timeout(CHECKOUT_TIMEOUT + 60)
@pytest.mark.parametrize("block", ORDERED, ids=[block.ident for block in ORDERED])
def test_docs_block_runs_as_written(
    block: Block,
    docs_env: DocsEnv,
    checkout_runs: dict[str, Future[str]],
    tmp_path: Path,
) -> None:
    reason = _skipped(block)
    if reason:
        pytest.skip(f"{block.ident}: {reason}")
    if block.directive("fresh-checkout"):
        checkout_runs[block.ident].result(timeout=CHECKOUT_TIMEOUT)
        return
    env = docs_env.for_page(block.relative)
    if block.directive("background"):
        run_background(block, env, REPO, tmp_path / "daemon.log")
    else:
        run_foreground(block, env, REPO)


def test_docs_annotations_are_well_formed_and_skips_allow_listed() -> None:
    """Unknown or misplaced directives fail; skips stay on the explicit allow-list."""
    assert ANNOTATION_ERRORS == [], "\n".join(ANNOTATION_ERRORS)
    skipped = [b for b in BLOCKS if _skipped(b)]
    listing = "\n".join(f"  {b.ident}: {b.first_line!r}: {_skipped(b)}" for b in skipped)
    print(f"skipped documentation blocks:\n{listing}")
    matched = {
        key
        for b in skipped
        for key in ALLOWED_SKIPS
        if key[0] == b.relative and b.first_line.startswith(key[1])
    }
    unlisted = [
        b.ident
        for b in skipped
        if not any(k[0] == b.relative and b.first_line.startswith(k[1]) for k in ALLOWED_SKIPS)
    ]
    assert not unlisted and matched == set(ALLOWED_SKIPS), (
        f"skipped blocks must match ALLOWED_SKIPS one to one; not allowed: {unlisted}, "
        f"allowed but not skipped: {sorted(set(ALLOWED_SKIPS) - matched)}\n{listing}"
    )
    executed = [b for b in BLOCKS if not _skipped(b)]
    assert len(executed) >= MIN_EXECUTED, f"only {len(executed)} blocks run"
    pages = {b.relative for b in executed}
    assert {"README.md", "docs/tutorial/1-in-memory.md", "docs/benchmarks.md"} <= pages


def test_annotation_parser_rejects_what_it_does_not_know(tmp_path: Path) -> None:
    """The parser names the line of an unknown, misplaced or unfinished annotation."""
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: sikp: typo -->\n```bash\ntrue\n```\n"
        "<!-- docs-test: skip: short -->\n```bash\ntrue\n```\n"
        "<!-- docs-test: background -->\n```python\nx = 1\n```\n"
        "<!-- docs-test: exit 3 -->\n```console\n$ false\n```\n"
        "<!-- docs-test: background -->\n```bash\na\nb\n```\n"
        "```sh\npip install -e .\n```\n"
        "<!-- docs-test: equivalent: cmd --never-mentioned -->\n```bash\nslow\n```\n"
        "```bash\nexport MQDEDUP_DATABASE_URL=x\nmqdedup db init\n```\n"
    )
    blocks, errors = parse(page, tmp_path)
    assert [b.line for b in blocks] == [2, 6, 14, 18, 22, 26, 29]
    assert blocks[2].directive("exit") is not None
    assert blocks[2].console_steps() == [("false", [])]
    joined = "\n".join(errors)
    for expected in (
        "page.md:L1: unknown docs-test directive",
        "page.md:L5: 'skip' needs a reason",
        "page.md:L9: docs-test comment before a python block",
        "page.md:L18: a background block must hold exactly one command",
        "page.md:L22: installs packages",
        "page.md:L26: the equivalent 'cmd --never-mentioned' is not mentioned",
        "page.md:L29: sets MQDEDUP_DATABASE_URL",
    ):
        assert expected in joined, joined


def test_the_runner_fails_a_block_on_its_first_failing_line_and_checks_console_output(
    tmp_path: Path,
) -> None:
    """What a broken doc looks like to the runner (no services needed)."""
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nfalse\necho after\n```\n"
        "```console\n$ echo took 3.2 s && echo done\ntook ... s\ndone\n```\n"
        "```console\n$ echo hello\nhello\n$ echo x\ny\n```\n"
        "```console\n$ false && echo never\n$ echo next\n```\n"
        "```bash\nsleep 60 &\n```\n"
    )
    blocks, errors = parse(page, tmp_path)
    assert errors == []
    env = {**os.environ}
    failing, passing, wrong_output, failing_chain, leaking = blocks
    with pytest.raises(AssertionError, match="exited 1, expected 0"):
        run_foreground(failing, env, tmp_path)
    assert "took 3.2 s" in run_foreground(passing, env, tmp_path)
    with pytest.raises(AssertionError, match="`echo x` did not print 'y'"):
        run_foreground(wrong_output, env, tmp_path)
    with pytest.raises(AssertionError, match="exited 1, expected 0"):
        run_foreground(failing_chain, env, tmp_path)
    with pytest.raises(AssertionError, match="left processes running"):
        run_foreground(leaking, env, tmp_path)


def test_every_python_block_of_the_docs_is_valid_python() -> None:
    """Python blocks are examples, not commands: each must at least compile (top-level
    ``await`` allowed, as in an async function's body); the ones a test runs as written
    (the tutorial's first block: ``tests/acceptance/test_examples.py``) say so nearby."""
    broken = []
    blocks = [block for path in doc_files(REPO) for block in python_blocks(path, REPO)]
    for ident, code in blocks:
        try:
            compile(code, ident, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
        except SyntaxError as error:
            broken.append(f"{ident} (+{error.lineno}): {error.msg}")
    assert len(blocks) >= 50, f"only {len(blocks)} python blocks found"
    assert not broken, "python blocks that do not compile:\n" + "\n".join(broken)
