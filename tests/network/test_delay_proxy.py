"""Tests for swarm.delay_proxy: the delay is added, per direction, without serializing chunks,
bytes pass unchanged, connections are independent, and only loopback addresses are accepted.

Everything binds 127.0.0.1 and is torn down by the test that starts it. pytest-asyncio is not
installed, so async tests run their body with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from swarm.delay_proxy import DelayProxy, ThreadedDelayProxy

pytestmark = pytest.mark.timeout(30)

# Scheduling slack we accept on top of the emulated delay. Generous so a loaded CI box still
# passes, yet far below what a serializing proxy would add (n * delay).
TOLERANCE_S = 0.080


@pytest.fixture(autouse=True)
def no_asyncio_errors(caplog):
    """Unhandled errors in proxy tasks only show up as asyncio log records; fail on them."""
    yield
    errors = [r for r in caplog.get_records("call") if r.name.startswith(("asyncio", "swarm")) and r.levelno >= 40]
    assert not errors, [r.getMessage() for r in errors]


@asynccontextmanager
async def echo_server():
    """An asyncio echo server on 127.0.0.1; it half-closes after echoing everything on EOF."""
    handlers: set[asyncio.Task] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        handlers.add(asyncio.current_task())
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
            await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            handlers.discard(asyncio.current_task())

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


async def _open(port: int):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return reader, writer


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except ConnectionError:
        pass


async def _rtt(port: int, rounds: int = 3) -> list[float]:
    reader, writer = await _open(port)
    try:
        rtts = []
        for i in range(rounds):
            msg = f"ping {i}\n".encode()
            t0 = time.monotonic()
            writer.write(msg)
            await writer.drain()
            assert await reader.readexactly(len(msg)) == msg
            rtts.append(time.monotonic() - t0)
        return rtts
    finally:
        await _close(writer)


def test_round_trip_gains_twice_the_delay():
    async def main():
        async with echo_server() as port:
            async with DelayProxy("127.0.0.1", port, delay_ms=50) as proxy:
                assert proxy.listen_port != 0
                rtts = await _rtt(proxy.listen_port)
            for rtt in rtts:
                # 50 ms each way -> at least 100 ms, at most 100 ms + TOLERANCE_S.
                assert 0.100 <= rtt < 0.100 + TOLERANCE_S, rtts

            async with DelayProxy("127.0.0.1", port, delay_ms=0) as proxy:
                rtts = await _rtt(proxy.listen_port)
            assert max(rtts) < 0.020, rtts

    asyncio.run(main())


def test_bytes_pass_unchanged_both_ways_and_eof_is_forwarded():
    payload = os.urandom(2 * 1024 * 1024 + 12345)

    async def main():
        async with echo_server() as port:
            async with DelayProxy("127.0.0.1", port, delay_ms=20) as proxy:
                reader, writer = await _open(proxy.listen_port)

                async def send():
                    view = memoryview(payload)
                    for i in range(0, len(payload), 7919):  # odd-sized writes
                        writer.write(view[i : i + 7919])
                        await writer.drain()
                    writer.write_eof()  # half-close: the echo server must still answer

                async def receive():
                    return await reader.read()  # until EOF, which the proxy forwards back

                _, echoed = await asyncio.gather(send(), receive())
                await _close(writer)
        assert len(echoed) == len(payload)
        assert echoed == payload

    asyncio.run(main())


def test_concurrent_connections_are_independent():
    async def main():
        async with echo_server() as port:
            async with DelayProxy("127.0.0.1", port, delay_ms=20) as proxy:

                async def client(k: int) -> bool:
                    reader, writer = await _open(proxy.listen_port)
                    try:
                        msgs = [f"conn {k} msg {i} ".encode() * (1 + k * 50) for i in range(20)]
                        expected = b"".join(msgs)

                        async def send():
                            for m in msgs:
                                writer.write(m)
                                await writer.drain()
                                await asyncio.sleep(0.001)
                            writer.write_eof()

                        _, got = await asyncio.gather(send(), reader.read())
                        return got == expected
                    finally:
                        await _close(writer)

                results = await asyncio.gather(*(client(k) for k in range(8)))
                assert all(results), results
                await asyncio.sleep(0.05)
                assert proxy.active_connections == 0

    asyncio.run(main())


def test_delay_is_not_serialized():
    delay_ms, n = 50, 20

    async def main():
        async with echo_server() as port:
            async with DelayProxy("127.0.0.1", port, delay_ms=delay_ms) as proxy:
                reader, writer = await _open(proxy.listen_port)
                msg = b"x" * 100
                # Back to back: all echoes are in within one round trip + tolerance of the first
                # send (a proxy that slept per chunk would need about n round trips).
                t0 = time.monotonic()
                for _ in range(n):
                    writer.write(msg)
                    await writer.drain()
                await reader.readexactly(n * len(msg))
                elapsed = time.monotonic() - t0
                assert 2 * delay_ms / 1000 <= elapsed < 2 * delay_ms / 1000 + TOLERANCE_S, elapsed

                # Spaced out so the proxy sees separate chunks: each one individually takes one
                # round trip, however many are in flight ahead of it.
                sent_at, latencies = [], []

                async def send():
                    for i in range(n):
                        sent_at.append(time.monotonic())
                        writer.write(bytes([i]) * 10)
                        await writer.drain()
                        await asyncio.sleep(0.005)

                async def receive():
                    for i in range(n):
                        assert await reader.readexactly(10) == bytes([i]) * 10
                        latencies.append(time.monotonic() - sent_at[i])

                await asyncio.gather(send(), receive())
                await _close(writer)
        for lat in latencies:
            assert 2 * delay_ms / 1000 <= lat < 2 * delay_ms / 1000 + TOLERANCE_S, latencies

    asyncio.run(main())


def test_one_way_delay_applies_per_direction():
    """A sink that timestamps arrival: one direction gains delay, not the round trip."""

    async def main():
        arrived = asyncio.get_running_loop().create_future()

        async def sink(reader, writer):
            await reader.readexactly(5)
            arrived.set_result(time.monotonic())
            writer.close()

        server = await asyncio.start_server(sink, "127.0.0.1", 0)
        try:
            async with DelayProxy("127.0.0.1", server.sockets[0].getsockname()[1], 60) as proxy:
                reader, writer = await _open(proxy.listen_port)
                t0 = time.monotonic()
                writer.write(b"hello")
                await writer.drain()
                one_way = await asyncio.wait_for(arrived, 5) - t0
                assert 0.060 <= one_way < 0.060 + TOLERANCE_S, one_way
                assert await reader.read() == b""  # sink's close reaches the client as EOF
                await _close(writer)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_slow_receiver_gets_backpressure_not_unbounded_buffering():
    async def main():
        may_read = asyncio.Event()
        received = bytearray()

        async def slow_sink(reader, writer):
            await may_read.wait()
            while data := await reader.read(65536):
                received.extend(data)
            writer.close()

        server = await asyncio.start_server(slow_sink, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        payload = os.urandom(64 * 1024 * 1024)
        try:
            async with DelayProxy("127.0.0.1", port, delay_ms=5, max_buffer_bytes=1024 * 1024) as proxy:
                reader, writer = await _open(proxy.listen_port)
                view, sent = memoryview(payload), 0

                async def send():
                    nonlocal sent
                    for i in range(0, len(payload), 1 << 20):
                        writer.write(view[i : i + (1 << 20)])
                        await writer.drain()
                        sent = i + (1 << 20)
                    writer.write_eof()

                sender = asyncio.create_task(send())
                await asyncio.sleep(0.3)
                # The sink reads nothing yet: the proxy must stop reading, so the sender stalls
                # (the kernel socket buffers on the way hold ~10 MB here, far less than 64 MB).
                assert not sender.done() and sent < len(payload) // 2, sent
                may_read.set()
                await asyncio.wait_for(sender, 20)
                assert await asyncio.wait_for(reader.read(), 20) == b""
                await _close(writer)
            assert bytes(received) == payload
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_unreachable_target_closes_client():
    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
        sock.close()  # nothing listens there now
        async with DelayProxy("127.0.0.1", dead_port, delay_ms=10) as proxy:
            reader, writer = await _open(proxy.listen_port)
            try:
                data = await asyncio.wait_for(reader.read(), 5)
            except ConnectionError:
                data = b""
            assert data == b""
            await _close(writer)

    asyncio.run(main())


def test_stop_closes_open_connections_and_listener():
    async def main():
        async with echo_server() as port:
            proxy = DelayProxy("127.0.0.1", port, delay_ms=10)
            await proxy.start()
            reader, writer = await _open(proxy.listen_port)
            writer.write(b"abc")
            await writer.drain()
            assert await reader.readexactly(3) == b"abc"
            await proxy.stop()
            try:
                assert await asyncio.wait_for(reader.read(), 5) == b""
            except ConnectionError:
                pass
            await _close(writer)
            with pytest.raises(OSError):
                await _open(proxy.listen_port)

    asyncio.run(main())


@pytest.mark.parametrize("host", ["10.0.0.1", "8.8.8.8", "0.0.0.0", "::", "2001:db8::1", "example.com", ""])
def test_non_loopback_is_refused(host):
    with pytest.raises(ValueError, match="loopback"):
        DelayProxy(host, 8000, delay_ms=10)
    with pytest.raises(ValueError, match="loopback"):
        DelayProxy("127.0.0.1", 8000, delay_ms=10, listen_host=host)
    with pytest.raises(ValueError, match="loopback"):
        ThreadedDelayProxy(host, 8000, delay_ms=10)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "localhost", "LOCALHOST"])
def test_loopback_is_accepted(host):
    DelayProxy(host, 8000, delay_ms=10, listen_host=host)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        DelayProxy("127.0.0.1", 8000, delay_ms=-1)
    with pytest.raises(ValueError):
        DelayProxy("127.0.0.1", 0, delay_ms=1)


class _ThreadedEcho(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            while data := self.request.recv(65536):
                self.request.sendall(data)


def test_threaded_proxy_from_sync_code():
    echo = _ThreadedEcho(("127.0.0.1", 0), _ThreadedEcho.Handler)
    echo_thread = threading.Thread(target=echo.serve_forever, daemon=True)
    echo_thread.start()
    try:
        with ThreadedDelayProxy("127.0.0.1", echo.server_address[1], delay_ms=30) as proxy:
            assert proxy.listen_port != 0
            with socket.create_connection(("127.0.0.1", proxy.listen_port), timeout=5) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t0 = time.monotonic()
                sock.sendall(b"hello proxy")
                got = b""
                while len(got) < 11:
                    got += sock.recv(64)
                rtt = time.monotonic() - t0
            assert got == b"hello proxy"
            assert 0.060 <= rtt < 0.060 + TOLERANCE_S, rtt
        # The proxy thread is gone and its port is closed.
        assert not [t for t in threading.enumerate() if t.name.startswith("delay-proxy")]
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", proxy.listen_port), timeout=1).close()
    finally:
        echo.shutdown()
        echo.server_close()
        echo_thread.join(5)


def test_threaded_proxy_reports_bind_errors():
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    try:
        proxy = ThreadedDelayProxy("127.0.0.1", 9, delay_ms=1, listen_port=blocker.getsockname()[1])
        with pytest.raises(OSError):
            proxy.start()
        proxy.stop()  # no-op after a failed start
    finally:
        blocker.close()


def test_cli_runs_until_sigterm():
    async def main():
        async with echo_server() as port:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "swarm.delay_proxy",
                "--target",
                f"127.0.0.1:{port}",
                "--delay-ms",
                "10",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=str(Path(__file__).resolve().parents[2]),
            )
            try:
                line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
                assert "listening on 127.0.0.1:" in line, line
                listen_port = int(line.split("127.0.0.1:")[1].split()[0])
                rtts = await _rtt(listen_port, rounds=1)
                assert 0.020 <= rtts[0] < 0.020 + TOLERANCE_S
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(proc.wait(), 10) == 0
                err = (await proc.stderr.read()).decode()
                assert "Traceback" not in err and "Exception in" not in err, err
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

    asyncio.run(main())


def test_cli_refuses_non_loopback():
    res = subprocess.run(
        [sys.executable, "-m", "swarm.delay_proxy", "--target", "10.1.2.3:80", "--delay-ms", "5"],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    assert res.returncode != 0
    assert "loopback" in res.stderr
