"""A TCP proxy on the running event loop that a test cuts: a database "stops".

Put it between an async worker and the shared PostgreSQL (``create_async_engine`` on
``127.0.0.1:<proxy.listen_port>``); ``cut()`` aborts every live connection and refuses
new ones, ``open()`` serves again on the same port. The shared database itself is never
stopped. The proxy only works while the loop is free: a worker that blocked the loop
would stall it, so a test through it also shows that every database wait is awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


class CuttableProxy:
    """A TCP proxy to PostgreSQL on the running event loop; ``cut`` drops everything."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.listen_port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._pipes: set[asyncio.Task[Any]] = set()

    async def open(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.listen_port, reuse_address=True
        )
        self.listen_port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """The database 'stops': new connections refused, live ones aborted."""
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.port)
        self._writers += [writer, upstream_writer]
        for pipe in (self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer)):
            task = asyncio.create_task(pipe)
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()
