"""Load generator of ``bench_service.py``: N concurrent HTTP/1.1 keep-alive clients in ONE asyncio process.

It runs as its own process (``python benchmarks/service_loadgen.py SPEC.json``) so that what it measures is
the server, not the generator: a thread-per-client generator inside the benchmark's own interpreter spends
most of a core on its own GIL and client library per request, and on a 2-core machine that CPU is taken from
the server it measures. Each client is a coroutine on a raw ``asyncio`` stream (one persistent connection,
one request in flight, no think time: a closed loop); a request's latency is from writing it to reading the
whole body. Prints one JSON object: the latencies (s) of each kind of request and the failures.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any


class Conn:
    """One keep-alive connection; ``request`` sends one request and reads the whole response."""

    def __init__(self, host: str, port: int, headers: dict[str, str]):
        self.host, self.port = host, port
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self.reader, self.writer

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        reader, writer = await self._open()
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self.extra}"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        writer.write(head.encode() + b"\r\n" + (body or b""))
        await writer.drain()
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("server closed the connection")
        status = int(status_line.split()[1])
        length, chunked, close = 0, False, False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "connection" and value == "close":
                close = True
        if chunked:
            parts = []
            while (size := int((await reader.readline()).split(b";")[0], 16)) > 0:
                parts.append(await reader.readexactly(size))
                await reader.readexactly(2)
            while await reader.readline() not in (b"\r\n", b""):
                pass
            data = b"".join(parts)
        else:
            data = await reader.readexactly(length)
        if close:
            await self.close()
        return status, data


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the clients of ``spec`` until its deadline or their request cap; the latencies and the failures."""
    host, port = spec["host"], spec["port"]
    headers = {"Authorization": f"Bearer {spec['token']}"}
    plan_body = json.dumps(spec["plan_body"]).encode()
    lat: dict[str, list[float]] = {"status": [], "plan": []}
    failures: list[str] = []
    stop_at = time.monotonic() + spec["seconds"]

    async def client(kind: str) -> None:
        conn = Conn(host, port, headers)
        try:
            for _ in range(spec["max_requests"]):
                if time.monotonic() >= stop_at:
                    return
                t0 = time.perf_counter()
                try:
                    if kind == "plan":
                        code, data = await conn.request("POST", "/api/plan", plan_body)
                        ok = code == 200 and bool(json.loads(data).get("feasible"))
                    else:
                        code, data = await conn.request("GET", f"/api/jobs/{spec['job_id']}")
                        ok = code == 200 and json.loads(data).get("id") == spec["job_id"]
                except (OSError, ValueError, asyncio.IncompleteReadError) as e:
                    ok, code, data = False, 0, str(e).encode()
                    await conn.close()
                dt = time.perf_counter() - t0
                if ok:
                    lat[kind].append(dt)
                else:
                    failures.append(f"{kind}: {code} {data[:200]!r}")
        finally:
            await conn.close()

    kinds = ["plan"] * spec["plan_clients"] + ["status"] * (spec["clients"] - spec["plan_clients"])
    t0 = time.monotonic()
    await asyncio.gather(*(client(k) for k in kinds))
    return {"status_s": lat["status"], "plan_s": lat["plan"], "errors": len(failures),
            "failures": failures[:5], "wall_s": time.monotonic() - t0}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())  # noqa: SIM115 - a one-shot read of the spec file
    json.dump(asyncio.run(run(spec)), sys.stdout)


if __name__ == "__main__":
    main()
