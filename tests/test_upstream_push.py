"""UpstreamResponse.push_to: reads handed to the relay's step in the connection's callback.

What the step takes never reaches readany(); what it declines, and everything that is not a
read while the reader waits (the body's end, an error), reaches the reader as without it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.upstream.conn import Connection, UpstreamResponse

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class _Transport:
    def write(self, data: bytes) -> None:
        pass

    def get_extra_info(self, name: str) -> Any:
        return None

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def abort(self) -> None:
        pass


class _Pool:
    def keep(self, conn: Connection) -> None:
        pass

    def forget(self, conn: Connection) -> None:
        pass


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _open() -> tuple[Connection, UpstreamResponse]:
    conn = Connection(asyncio.get_running_loop(), ("127.0.0.1", 1, False))
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    conn.data_received(HEAD)
    return conn, UpstreamResponse(conn, _Pool())


def test_reads_go_to_the_sink_while_the_reader_waits_and_what_it_declines_to_the_reader() -> None:
    async def main() -> None:
        conn, resp = await _open()
        took: list[bytes] = []

        def sink(data: bytes) -> bool:
            if data.startswith(b"data: no"):
                return False
            took.append(data)
            return True

        resp.push_to(sink)
        reader = asyncio.ensure_future(resp.readany())
        await asyncio.sleep(0)  # waiting
        conn.data_received(_chunk(b"data: 1\n\n"))
        conn.data_received(_chunk(b"data: 2\n\n"))
        await asyncio.sleep(0)
        assert took == [b"data: 1\n\n", b"data: 2\n\n"] and not reader.done()
        conn.data_received(_chunk(b"data: no\n\n"))  # declined: the reader's
        assert await reader == b"data: no\n\n"
        conn.data_received(_chunk(b"data: 3\n\n"))  # nobody waits: buffered, in order
        assert await resp.readany() == b"data: 3\n\n"
        reader = asyncio.ensure_future(resp.readany())
        await asyncio.sleep(0)
        conn.data_received(_chunk(b"data: last\n\n") + b"0\r\n\r\n")  # with the body's end
        assert await reader == b"data: last\n\n"  # the reader's: it has the end to see
        assert await resp.readany() == b""
        assert took == [b"data: 1\n\n", b"data: 2\n\n"]

    asyncio.run(main())


def test_an_error_in_the_sink_is_raised_where_the_reader_reads() -> None:
    async def main() -> None:
        conn, resp = await _open()

        def sink(data: bytes) -> bool:
            raise RuntimeError("bug in the step")

        resp.push_to(sink)
        reader = asyncio.ensure_future(resp.readany())
        await asyncio.sleep(0)
        conn.data_received(_chunk(b"data: 1\n\n"))
        with pytest.raises(RuntimeError, match="bug in the step"):
            await reader

    asyncio.run(main())


def test_no_sink_after_push_to_none_or_on_the_next_response() -> None:
    async def main() -> None:
        conn, resp = await _open()
        resp.push_to(lambda data: True)
        resp.push_to(None)
        reader = asyncio.ensure_future(resp.readany())
        await asyncio.sleep(0)
        conn.data_received(_chunk(b"data: 1\n\n"))
        assert await reader == b"data: 1\n\n"
        resp.push_to(lambda data: True)
        conn.reset()  # a pooled connection's next response starts without one
        assert conn._sink is None

    asyncio.run(main())


def test_at_end_is_true_once_the_body_ended_and_every_byte_of_it_was_read() -> None:
    async def main() -> None:
        conn, resp = await _open()
        conn.data_received(_chunk(b"data: 1\n\n"))
        assert not resp.at_end()  # bytes unread, and no end yet
        assert await resp.readany() == b"data: 1\n\n"
        assert not resp.at_end()  # read, but the body goes on
        conn.data_received(_chunk(b"data: last\n\n") + b"0\r\n\r\n")
        assert not resp.at_end()  # ended, but its last bytes are unread
        assert await resp.readany() == b"data: last\n\n"
        assert resp.at_end()  # the relay writes these with the end (relay._forward)
        assert await resp.readany() == b""

    asyncio.run(main())


def test_at_end_is_false_for_a_body_that_broke() -> None:
    async def main() -> None:
        conn, resp = await _open()
        conn.data_received(_chunk(b"data: 1\n\n"))
        conn.connection_lost(None)  # cut before the terminating chunk
        assert await resp.readany() == b"data: 1\n\n"
        assert not resp.at_end()

    asyncio.run(main())
