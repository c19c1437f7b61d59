"""The suite's outputs: machine description, results.md and PNG charts (matplotlib, Agg)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.suite_common import Section, Settings, fmt

LIBRARIES = ("mqdedup", "sqlalchemy", "psycopg", "kafka-python", "crc32c", "pika", "matplotlib")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine(settings: Settings) -> dict[str, str]:
    """nproc, memory, CPU, OS and the service and library versions."""
    info: dict[str, str] = {"nproc": str(os.cpu_count())}
    try:
        meminfo = Path("/proc/meminfo").read_text()
        kib = int(re.search(r"MemTotal:\s+(\d+)", meminfo).group(1))  # type: ignore[union-attr]
        info["memory"] = f"{kib / 1024 / 1024:.1f} GiB"
    except (OSError, AttributeError):
        info["memory"] = "unknown"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        match = re.search(r"model name\s*:\s*(.+)", cpuinfo)
        info["CPU"] = match.group(1).strip() if match else platform.processor()
    except OSError:
        info["CPU"] = platform.processor()
    info["OS"] = f"{platform.system()} {platform.release()}"
    info["Python"] = sys.version.split()[0]
    try:
        from sqlalchemy import text

        from mqdedup import create_engine

        engine = create_engine(settings.database_url)
        with engine.connect() as connection:
            info["PostgreSQL"] = str(connection.execute(text("SHOW server_version")).scalar())
            settings_shown = (
                "shared_buffers",
                "synchronous_commit",
                "fsync",
                "max_wal_size",
                "work_mem",
            )
            info["PostgreSQL settings"] = ", ".join(
                f"{name}={connection.execute(text(f'SHOW {name}')).scalar()}"
                for name in settings_shown
            )
        engine.dispose()
    except Exception as error:
        info["PostgreSQL"] = f"unknown ({type(error).__name__})"
    libs = os.environ.get("MQDEDUP_KAFKA_LIBS", "")
    jars = sorted(Path(libs).glob("kafka_2.13-*.jar")) if libs else []
    info["Kafka"] = (
        jars[0].name.removeprefix("kafka_2.13-").removesuffix(".jar") + " (KRaft, single node)"
        if jars
        else "unknown (MQDEDUP_KAFKA_LIBS not set)"
    )
    try:
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
        properties = connection._impl.server_properties
        version = properties.get("version", b"?")
        info["RabbitMQ"] = version.decode() if isinstance(version, bytes) else str(version)
        connection.close()
    except Exception as error:
        info["RabbitMQ"] = f"unknown ({type(error).__name__})"
    try:
        java = subprocess.run(["java", "-version"], capture_output=True, text=True, check=False)
        info["Java"] = java.stderr.splitlines()[0] if java.stderr else "unknown"
    except OSError:
        info["Java"] = "not found"
    info["libraries"] = ", ".join(f"{name} {_version(name)}" for name in LIBRARIES)
    return info


def section_markdown(section: Section) -> str:
    lines = [f"### {section.title}", "", section.description, ""]
    if section.error:
        lines += [f"**Not measured: {section.error}**", ""]
        return "\n".join(lines)
    if not section.rows:
        return "\n".join(lines)
    reference = section.rows[0].median
    ratio = section.key in {"kafka", "rabbitmq", "handlers", "claim"}
    notes_column = any(row.note for row in section.rows)
    header = "| variant | median | unit | runs |" + (" vs first row |" if ratio else "")
    header += " note |" if notes_column else ""
    lines.append(header)
    lines.append(
        "|---|---:|---|---|" + ("---:|" if ratio else "") + ("---|" if notes_column else "")
    )
    for row in section.rows:
        runs = ", ".join(fmt(value, row.unit) for value in row.values)
        line = f"| {row.variant} | {fmt(row.median, row.unit)} | {row.unit} | {runs} |"
        if ratio:
            line += f" {row.median / reference:.0%} |" if reference else " |"
        if notes_column:
            line += f" {row.note} |"
        lines.append(line)
    notes = [f"{key}: {value}" for key, value in section.extra.items() if isinstance(value, str)]
    if notes:
        lines += ["", "; ".join(notes) + "."]
    lines.append("")
    return "\n".join(lines)


def headline_table(sections: dict[str, Section]) -> str:
    """Kafka and RabbitMQ consumer variants side by side (the README table)."""
    kafka, rabbit = sections.get("kafka"), sections.get("rabbitmq")
    first = kafka or rabbit
    names = [row.variant for row in first.rows] if first else []
    if not names:
        return ""
    lines = [
        "| consumer → PostgreSQL (msgs/s, median) | Kafka | RabbitMQ |",
        "|---|---:|---:|",
    ]
    for name in names:
        cells = []
        for section in (kafka, rabbit):
            row = section.row(name) if section and not section.error else None
            cells.append(fmt(row.median, row.unit) if row else "n/a")
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def results_markdown(
    sections: Sequence[Section], info: dict[str, str], mode: str, runs: int, wall: float
) -> str:
    by_key = {section.key: section for section in sections}
    parts = [
        "# mqdedup benchmark results",
        "",
        f"Produced by `python -m bench{' --quick' if mode == 'quick' else ''}` ({mode} mode, "
        f"medians of {runs} runs unless a row shows one value; wall time {wall / 60:.1f} min). "
        "All services on loopback on the same machine as the benchmark. The benchmark "
        "process runs with `mqdedup.tune_gc()` applied, the garbage collector settings of "
        "`mqdedup worker` and `mqdedup relay`, for every variant: the raw and hand-written "
        "loops too.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in info.items()],
        "",
        "## Summary",
        "",
        headline_table(by_key),
        "![consumer throughput](consumers.png)",
        "",
        "## Details",
        "",
    ]
    parts += [section_markdown(section) for section in sections]
    parts.append("Charts: " + ", ".join(f"[{name}]({name})" for name in CHARTS) + ".")
    return "\n".join(parts) + "\n"


# -- charts --------------------------------------------------------------------------------

CHARTS = ("consumers.png", "relay.png", "claim.png", "memory.png")


def _bar_labels(axis: Any, bars: Any, unit: str) -> None:
    for bar in bars:
        width = bar.get_width()
        if width == width:
            axis.text(
                width,
                bar.get_y() + bar.get_height() / 2,
                f" {fmt(width, unit)}",
                va="center",
                fontsize=8,
            )


def charts(sections: Sequence[Section], out: Path, subtitle: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_key = {s.key: s for s in sections if not s.error and s.rows}
    written: list[Path] = []

    def save(figure: Any, name: str) -> None:
        figure.text(0.99, 0.01, subtitle, ha="right", va="bottom", fontsize=7, color="gray")
        figure.tight_layout(rect=(0, 0.03, 1, 1))
        path = out / name
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)

    consumer_sections = [by_key[k] for k in ("kafka", "rabbitmq") if k in by_key]
    if consumer_sections:
        figure, axes = plt.subplots(
            1,
            len(consumer_sections),
            figsize=(4.5 + 4.5 * len(consumer_sections), 4.4),
            squeeze=False,
            sharey=True,
        )
        colors = ["#9e9e9e", "#1b7837", "#5aae61", "#f1a340", "#d6604d"]
        for axis, section in zip(axes[0], consumer_sections, strict=True):
            rows = list(reversed(section.rows))
            bars = axis.barh(
                [r.variant for r in rows],
                [r.median for r in rows],
                color=list(reversed(colors[: len(rows)])),
            )
            _bar_labels(axis, bars, "msgs/s")
            axis.set_title(section.title, fontsize=10)
            axis.set_xlabel("messages/s (median, higher is better)")
            axis.set_xlim(0, max(r.median for r in rows) * 1.25)
            axis.tick_params(axis="y", labelsize=9)
            axis.xaxis.set_major_formatter(
                matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1000:,.0f}k" if v else "0")
            )
        save(figure, "consumers.png")

    relay, latency = by_key.get("relay"), by_key.get("latency")
    if relay or latency:
        figure, axes = plt.subplots(1, 2, figsize=(12, 4.2), squeeze=False)
        if relay:
            axis = axes[0][0]
            rows = list(reversed(relay.rows))
            bars = axis.barh(
                [r.variant for r in rows],
                [r.median for r in rows],
                color=["#5aae61" if "relay" in r.variant else "#9e9e9e" for r in rows],
            )
            _bar_labels(axis, bars, "msgs/s")
            axis.set_xlim(0, max(r.median for r in rows) * 1.25)
            axis.set_title(relay.title, fontsize=10)
            axis.set_xlabel("messages/s (median)")
        if latency:
            axis = axes[0][1]
            rows = list(reversed(latency.rows))
            bars = axis.barh(
                [r.variant for r in rows],
                [r.median for r in rows],
                color=["#2166ac" if "NOTIFY" in r.variant else "#f1a340" for r in rows],
            )
            _bar_labels(axis, bars, "ms")
            axis.set_xscale("log")
            axis.set_title(latency.title, fontsize=10)
            axis.set_xlabel("milliseconds, log scale (lower is better)")
            axis.set_xlim(right=max(r.median for r in rows) * 4)
        for axis in axes[0]:
            axis.tick_params(axis="y", labelsize=8)
        save(figure, "relay.png")

    claim, purge = by_key.get("claim"), by_key.get("purge")
    if claim or purge:
        figure, axes = plt.subplots(1, 2, figsize=(12, 4.2), squeeze=False)
        if claim:
            axis = axes[0][0]
            bars = axis.bar(
                [r.variant for r in claim.rows], [r.median for r in claim.rows], color="#1b7837"
            )
            for bar in bars:
                axis.text(
                    bar.get_x() + bar.get_width() / 2,
                    bar.get_height(),
                    fmt(bar.get_height(), "msgs/s"),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
            axis.set_ylabel("claims/s (median, batches of 500)")
            axis.set_xlabel("rows already in the dedup table")
            axis.set_title(claim.title, fontsize=10)
            axis.set_ylim(0, max(r.median for r in claim.rows) * 1.15)
        if purge and purge.rows:
            axis = axes[0][1]
            rows = list(reversed(purge.rows))
            bars = axis.barh(
                [r.variant.replace(" (not mqdedup code)", "\n(not mqdedup code)") for r in rows],
                [r.median for r in rows],
                color=["#9e9e9e" if "reference" in r.variant else "#d6604d" for r in rows],
            )
            _bar_labels(axis, bars, "rows/s")
            axis.set_xscale("log")
            axis.set_xlim(right=max(r.median for r in rows) * 6)
            axis.set_xlabel("rows deleted per second, log scale")
            axis.set_title(purge.title, fontsize=10)
            axis.tick_params(axis="y", labelsize=8)
        save(figure, "claim.png")

    memory = by_key.get("memory")
    if memory and memory.extra.get("samples"):
        samples = memory.extra["samples"]
        figure, axis = plt.subplots(figsize=(7, 4))
        axis.plot([p for p, _ in samples], [r for _, r in samples], marker=".", color="#2166ac")
        axis.set_xlabel("messages processed")
        axis.set_ylabel("worker RSS (MiB)")
        axis.set_ylim(0, max(r for _, r in samples) * 1.3)
        axis.ticklabel_format(axis="x", style="plain")
        axis.xaxis.set_major_formatter(
            matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1000:,.0f}k")
        )
        peak = memory.rows[0].median
        axis.axhline(peak, color="gray", linestyle="--", linewidth=0.8)
        axis.text(0, peak, f" peak {peak:.0f} MiB", va="bottom", fontsize=8, color="gray")
        axis.set_title(
            f"{memory.title}: {samples[-1][0]:,} messages, in-memory broker → PostgreSQL",
            fontsize=10,
        )
        save(figure, "memory.png")
    return written
