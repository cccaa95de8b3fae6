"""A lean HTTP/1.1 client for load generation: one kept-alive connection per simulated client, each
request written as prepared bytes and each answer read by its Content-Length.

The load generator shares the machine with the server it measures (2 cores here): httpx spent
about 2 ms of CPU per request, a quarter of a core at 140 requests/s, taken from the server under
test; this client spends a fraction of that. It speaks only what the benchmarks need: POST with
a JSON body, answers with a Content-Length (what uvicorn sends for every route here).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self):
        return json.loads(self.body)


class Connection:
    """One kept-alive connection to `base` (http://host:port); reopened after a failure, and when the
    server has closed it while idle."""

    def __init__(self, base: str):
        parts = urlsplit(base)
        self.host, self.port = parts.hostname, parts.port or 80
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict, timeout: float) -> Answer:
        payload = json.dumps(body).encode()
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
        try:
            return await asyncio.wait_for(self._exchange(request), timeout)
        except BaseException:
            await self.close()  # a half-read answer must not be taken for the next one's
            raise

    async def _exchange(self, request: bytes) -> Answer:
        reused = self._writer is not None and not self._reader.at_eof()
        if not reused:
            await self.close()
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        try:
            self._writer.write(request)
            raw_head = await self._reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
            if not reused or getattr(exc, "partial", b""):
                raise
            # The server closed the idle kept-alive connection (uvicorn: after 5 s) as the request
            # went out, and answered none of it: send it once more, on a new connection.
            await self.close()
            return await self._exchange(request)
        head = raw_head.decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        headers = {}
        for line in head[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        body = await self._reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return Answer(status, headers, body)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass
        self._reader = self._writer = None
