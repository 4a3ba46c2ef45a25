"""An emulated WAN in front of a loopback HTTP endpoint: latency + bandwidth.

    python benchmarks/wanproxy.py --upstream 127.0.0.1:PORT --latency-ms 20 --rate-mbps 25

prints ``listening 127.0.0.1:<port>`` once ready, then forwards every
connection to the upstream, shaping it as a far-away object store would:

* latency: each *request* waits ``--latency-ms`` before it is forwarded. A
  request is recognised at the TCP level as the first bytes the client sends
  after the server last spoke (HTTP/1.1 keeps one request in flight per
  connection), so keep-alive connections pay it per request, like a round trip.
* bandwidth: each connection is paced to ``--rate-mbps`` megabytes per second
  in each direction (a token bucket), so one stream cannot go faster than a
  single TCP flow to a distant region; more parallel connections -- multipart
  uploads, ranged GETs -- go faster, which is the point of measuring them.
  ``--total-mbps`` also paces what the endpoint sends over all connections
  together (0, the default: no limit): the endpoint's own throughput, shared
  by every client, which is what many ranks reading one checkpoint meet.

With ``--count FILE`` it writes the bytes the endpoint has sent (responses,
headers included) to FILE each time a connection closes: what a load fetched,
counted where the object store would bill it.

It runs as its own process so its work never competes with the benchmark
for the GIL. Loopback only: it refuses to listen or forward anywhere else.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import signal
import sys
import time

CHUNK = 256 * 1024


class Pacer:
    """Token bucket: ``wait(n)`` sleeps so the long-run rate stays <= rate."""

    def __init__(self, rate_bps: float) -> None:
        self.rate = rate_bps
        self.next_free = time.monotonic()

    async def wait(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self.next_free = max(self.next_free, now) + nbytes / self.rate
        delay = self.next_free - now
        if delay > 0.001:
            await asyncio.sleep(delay)


class Counter:
    """Bytes the endpoint sent, over all connections; written to ``path`` on request."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.down = 0

    def write(self) -> None:
        if self.path:
            with open(self.path + ".tmp", "w") as f:
                f.write(str(self.down))
            os.replace(self.path + ".tmp", self.path)


class Connection:
    def __init__(self, latency_s: float, rate_bps: float, counter: Counter, total: Pacer) -> None:
        self.counter = counter
        self.total = total
        self.latency_s = latency_s
        self.up = Pacer(rate_bps)
        self.down = Pacer(rate_bps)
        self.server_spoke = True  # a new connection's first bytes are a request

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool) -> None:
        pacer = self.up if upstream else self.down
        try:
            while data := await reader.read(CHUNK):
                if upstream and self.server_spoke:
                    self.server_spoke = False
                    await asyncio.sleep(self.latency_s)
                elif not upstream:
                    self.server_spoke = True
                    self.counter.down += len(data)
                    await self.total.wait(len(data))
                await pacer.wait(len(data))
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            try:
                if writer.can_write_eof():
                    writer.write_eof()
            except (OSError, RuntimeError):
                writer.close()


async def serve(
    upstream: tuple[str, int],
    port: int,
    latency_s: float,
    rate_bps: float,
    count: str | None = None,
    total_bps: float = 0.0,
) -> None:
    counter = Counter(count)
    total = Pacer(total_bps)
    counter.write()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*upstream)
        except OSError:
            client_w.close()
            return
        conn = Connection(latency_s, rate_bps, counter, total)
        await asyncio.gather(conn.pump(client_r, server_w, True), conn.pump(server_r, client_w, False))
        for w in (client_w, server_w):
            w.close()
        counter.write()

    server = await asyncio.start_server(handle, "127.0.0.1", port, limit=CHUNK * 4)
    host, bound = server.sockets[0].getsockname()[:2]
    print(f"listening {host}:{bound}", flush=True)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    async with server:
        await stop


def _loopback(host: str) -> str:
    if host == "localhost" or ipaddress.ip_address(host).is_loopback:
        return host
    raise SystemExit(f"wanproxy: {host} is not a loopback address; this proxy only forwards on loopback")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream", required=True, help="HOST:PORT of the endpoint (loopback)")
    p.add_argument("--port", type=int, default=0, help="listen port (default: a free one)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="added per request (default 20)")
    p.add_argument("--rate-mbps", type=float, default=25.0, help="MB/s per connection and direction; 0 = unlimited")
    p.add_argument("--total-mbps", type=float, default=0.0, help="MB/s the endpoint sends in all; 0 = unlimited")
    p.add_argument("--count", default=None, help="write the bytes the endpoint sent here as connections close")
    args = p.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    endpoint = (_loopback(host), int(port))
    rates = (args.rate_mbps * 1e6, args.count, args.total_mbps * 1e6)
    asyncio.run(serve(endpoint, args.port, args.latency_ms / 1e3, *rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
