"""A TCP proxy that delays every byte by a fixed time in each direction: the
link between two test hosts (network namespaces) where the kernel has no
netem qdisc. Order is kept; bandwidth is not limited.

    python3 delay_proxy.py --listen 127.0.0.1:4222 --to 10.0.0.2:4222 --delay-ms 20 [--stats FILE]

With --stats, FILE holds the bytes carried so far (both ways), rewritten
every 100 ms: a test's proof that its traffic went through the link.

SIGUSR1 cuts every connection open now (both ends reset, whatever was in
flight lost) and prints "cut N"; new connections pass again at once: a
process's short network outage.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time

CARRIED = [0]
OPEN: set = set()


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
            CARRIED[0] += len(data)
        writer.close()

    task = asyncio.create_task(deliver())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((time.monotonic() + delay, data))
    except (ConnectionError, OSError):
        pass
    queue.put_nowait((0.0, None))
    try:
        await task
    except (ConnectionError, OSError):
        pass


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", required=True)
    ap.add_argument("--to", required=True)
    ap.add_argument("--delay-ms", type=float, required=True)
    ap.add_argument("--stats")
    a = ap.parse_args()
    lhost, lport = a.listen.rsplit(":", 1)
    thost, tport = a.to.rsplit(":", 1)
    delay = a.delay_ms / 1000.0

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(thost, int(tport))
        except OSError:
            cw.close()
            return
        ends = (cw, uw)
        OPEN.add(ends)
        try:
            await asyncio.gather(pipe(cr, uw, delay), pipe(ur, cw, delay))
        finally:
            OPEN.discard(ends)

    def cut() -> None:
        n = len(OPEN)
        for ends in list(OPEN):
            for w in ends:
                w.transport.abort()
        OPEN.clear()
        print(f"cut {n}", flush=True)

    async def stats(path: str) -> None:
        while True:
            with open(path + ".tmp", "w") as f:
                f.write(str(CARRIED[0]))
            os.replace(path + ".tmp", path)
            await asyncio.sleep(0.1)

    if a.stats:
        asyncio.create_task(stats(a.stats))
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, cut)
    server = await asyncio.start_server(handle, lhost, int(lport))
    print("delay proxy ready", flush=True)
    async with server:
        await server.serve_forever()


asyncio.run(main())
