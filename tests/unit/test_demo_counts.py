"""The demo counts one thing with one word (issue 43).

Its progress line used to count "6,590 deliveries" and its summary "6,930 deliveries":
two different things under one word. Now a *message* is a record put on the queue
(settled once) and a *delivery* a hand-off to a worker (redeliveries included); the
progress line's total is the summary's "messages sent".
"""

from __future__ import annotations

import io
import re

from mqdedup.cli.demo import format_summary, run_demo


def test_progress_and_summary_count_the_same_messages_with_the_same_word() -> None:
    progress = io.StringIO()  # not a terminal: plain lines every quarter
    result = run_demo(messages=400, duplicate_rate=0.3, crash_rate=0.2, seed=3, progress=progress)
    assert result.exactly_once and result.nothing_lost
    lines = progress.getvalue().splitlines()
    matches = [re.match(r"demo: (\d+)/(\d+) messages settled", line) for line in lines]
    totals = {int(m.group(2)) for m in matches if m}
    assert totals == {result.sent}, lines
    assert not any("deliver" in line for line in lines), lines

    summary = format_summary(result)
    sent_line = next(line for line in summary.splitlines() if "messages sent" in line)
    delivered_line = next(line for line in summary.splitlines() if "deliveries" in line)
    assert int(sent_line.split()[-1]) == result.sent
    assert int(delivered_line.split()[-1]) == result.delivered
    # Crashes struck between commit and ack: deliveries exceed messages by the redeliveries.
    assert result.crashes > 0 and result.delivered > result.sent
    # The messages sent: every order, the producers' resends, the two bad ones.
    assert result.sent > result.unique + result.expected_dead_letters
