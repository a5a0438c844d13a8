"""`protocol.settle`: once it returns, the server holds the subscription made just before, so a message
another connection sends at once is delivered — the promise the draft pool's start and a KV transfer's
receiver make to their peers.

Real nats-server and nats-py. The server is reached through a loopback proxy that holds back every chunk
the client writes for 200 ms, in order, except a PING at a chunk's start, which goes on at once: a server
that reads a SUB later than the PING written before it, as a loaded machine sometimes does. nats-py's `flush()` writes its PING straight
to the socket, ahead of a SUB still in the client's pending buffer, so with `flush()` alone the PONG comes
back before the subscription exists; this is how a draft report got lost in CI (the test waiting for it
hung until pytest's timeout).
"""
from __future__ import annotations

import asyncio

import nats

from pdserve.kvtransfer.protocol import settle

HOLD_S = 0.2


class SlowSubProxy:
    """Loopback TCP proxy: server → client as it comes; client → server in order, each chunk held for HOLD_S
    first, save the PINGs it starts with. Counts the chunks it held and the PINGs it passed straight on."""

    def __init__(self, port: int):
        self.port = port
        self.held = 0
        self.pings_first = 0
        self._server = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _conn(self, c_reader, c_writer):
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", self.port)

        async def pipe(reader, writer, hold):
            try:
                while data := await reader.read(65536):
                    if hold:
                        while data.startswith(b"PING\r\n"):  # a leading PING goes on at once, the rest waits
                            self.pings_first += 1
                            writer.write(data[:6])
                            data = data[6:]
                        if data:
                            self.held += 1
                            await asyncio.sleep(HOLD_S)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(c_reader, s_writer, True), pipe(s_reader, c_writer, False))

    async def close(self):
        self._server.close()


def test_a_subscription_is_the_servers_once_settle_returns(nats_server):
    async def main():
        proxy = SlowSubProxy(int(nats_server.creds.url.rsplit(":", 1)[1]))
        port = await proxy.start()
        kw = nats_server.creds.connect_kwargs()
        slow = await nats.connect(**{**kw, "servers": [f"nats://127.0.0.1:{port}"]})
        fast = await nats.connect(**kw)
        for i in range(5):
            got: asyncio.Queue = asyncio.Queue()

            async def cb(msg):
                await got.put(msg.data)

            held = proxy.held
            sub = await slow.subscribe(f"settle.test.{i}", cb=cb)
            await settle(slow)
            assert proxy.held > held  # the SUB did come late to the server
            await fast.publish(f"settle.test.{i}", b"m%d" % i)
            await fast.flush()
            assert await asyncio.wait_for(got.get(), 5.0) == b"m%d" % i
            await sub.unsubscribe()
        assert proxy.pings_first > 0  # and PINGs went straight on: without settle's ordering, one would overtake
        await slow.close()
        await fast.close()
        await proxy.close()

    asyncio.run(main())
