"""A user-space TCP proxy that adds a fixed one-way delay, for emulating a WAN on one machine.

Why: a swarm spread over the internet is slow because of network latency, not because of the GPU.
Every generated token crosses each server hop at least once, so tens of milliseconds per hop
dominate the per-token time long before compute does. Benchmarks and tests that run every peer on
one host see loopback latency (microseconds) and would say nothing about how the swarm behaves
over a WAN. The usual tool, ``tc qdisc ... netem delay``, needs a kernel module and root, which the
machines we run on do not have, so we emulate the latency in user space instead: put a
:class:`DelayProxy` in front of a server's listen port and let peers dial the proxy.

What it does: every chunk read from one side is timestamped and queued (one FIFO queue per
direction); a writer task sleeps until ``read time + delay`` and then writes the chunk to the other
side. Chunks in flight overlap, exactly like packets on a long link, so the proxy adds latency but
does not limit throughput (a stream of n chunks arrives about ``delay`` after it was sent, not
``n * delay``). Byte order is preserved, EOF (half-close) is forwarded after the bytes queued ahead
of it, and a failure on either side closes both. Only the data is delayed; the TCP handshake
between the client and the proxy is not, so a connection's first bytes pay one-way ``delay`` like
any others.

Safety: both the listen address and the target must be loopback (``127.0.0.0/8``, ``::1`` or
``localhost``); anything else raises :class:`ValueError`, so a test or benchmark can never send
traffic off the machine through this module.

Use from asyncio code::

    async with DelayProxy("127.0.0.1", server_port, delay_ms=25) as proxy:
        ...  # dial 127.0.0.1:proxy.listen_port

from synchronous code (the proxy runs its own event loop in a daemon thread)::

    with ThreadedDelayProxy("127.0.0.1", server_port, delay_ms=25) as proxy:
        ...

or from a shell::

    python -m swarm.delay_proxy --target 127.0.0.1:PORT --delay-ms 25 [--listen-port P]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ipaddress
import logging
import signal
import socket
import sys
import threading
from typing import Optional

logger = logging.getLogger(__name__)

_CHUNK = 64 * 1024  # bytes per read
_DEFAULT_MAX_BUFFER_BYTES = 16 * 1024 * 1024  # per direction; caps throughput at this / delay
_CONNECT_TIMEOUT_S = 10.0


def _is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.strip().strip("[]"))
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _check_loopback(what: str, host: str) -> None:
    if not isinstance(host, str) or not _is_loopback(host):
        raise ValueError(
            f"DelayProxy {what} must be a loopback address (127.0.0.0/8, ::1 or 'localhost'), "
            f"got {host!r}: the delay proxy only emulates a WAN on this machine and never "
            f"sends traffic elsewhere"
        )


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _DelayLine:
    """A FIFO of ``(due_time, chunk)`` for one direction, bounded by the bytes it holds.

    One producer, one consumer. The bound gives backpressure: when the far side stops reading,
    the producer stops reading too and TCP flow control pushes back to the sender.
    """

    def __init__(self, max_bytes: int):
        self._items: collections.deque[tuple[float, bytes]] = collections.deque()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._ready = asyncio.Event()
        self._space = asyncio.Event()

    async def put(self, due: float, data: bytes) -> None:
        while self._bytes >= self._max_bytes:
            self._space.clear()
            await self._space.wait()
        self._items.append((due, data))
        self._bytes += len(data)
        self._ready.set()

    async def get(self) -> tuple[float, bytes]:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        due, data = self._items.popleft()
        self._bytes -= len(data)
        self._space.set()
        return due, data


class DelayProxy:
    """Forward TCP connections from ``listen_host:listen_port`` to ``target_host:target_port``,
    delaying every byte by ``delay_ms`` in each direction (so a round trip gains ``2 * delay_ms``).

    ``listen_port=0`` binds an ephemeral port; :attr:`listen_port` holds the bound port after
    :meth:`start`. Both hosts must be loopback (see the module docstring).
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        delay_ms: float,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        *,
        max_buffer_bytes: int = _DEFAULT_MAX_BUFFER_BYTES,
    ):
        _check_loopback("target_host", target_host)
        _check_loopback("listen_host", listen_host)
        if not 0 < int(target_port) < 65536:
            raise ValueError(f"target_port must be in 1..65535, got {target_port!r}")
        if not 0 <= int(listen_port) < 65536:
            raise ValueError(f"listen_port must be in 0..65535, got {listen_port!r}")
        if not delay_ms >= 0:  # also rejects NaN
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms!r}")
        if max_buffer_bytes <= 0:
            raise ValueError(f"max_buffer_bytes must be > 0, got {max_buffer_bytes!r}")
        self.target_host = target_host
        self.target_port = int(target_port)
        self.delay_ms = float(delay_ms)
        # "localhost" may resolve to both 127.0.0.1 and ::1; with port 0 each would get its own
        # ephemeral port, so bind one address and report one port.
        self.listen_host = "127.0.0.1" if listen_host.strip().lower() == "localhost" else listen_host
        self.listen_port = int(listen_port)
        self.max_buffer_bytes = int(max_buffer_bytes)
        self._server: Optional[asyncio.base_events.Server] = None
        self._connections: set[asyncio.Task] = set()
        self._closing = False

    @property
    def active_connections(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("DelayProxy already started")
        self._closing = False
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.listen_port, limit=2 * _CHUNK)
        self.listen_port = self._server.sockets[0].getsockname()[1]
        logger.debug(
            "delay proxy %s:%d -> %s:%d, %.1f ms each way",
            self.listen_host,
            self.listen_port,
            self.target_host,
            self.target_port,
            self.delay_ms,
        )

    async def stop(self) -> None:
        """Stop listening and close every open connection (queued bytes are dropped)."""
        self._closing = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> "DelayProxy":
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter):
        try:
            await self._serve_connection(client_reader, client_writer)
        except asyncio.CancelledError:
            # stop() cancels connections. End normally: asyncio's done-callback for
            # client_connected_cb calls task.exception(), which would log a cancelled task as an error.
            pass

    async def _serve_connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._closing:
            client_writer.transport.abort()
            return
        self._connections.add(task)
        target_writer: Optional[asyncio.StreamWriter] = None
        ok = False
        try:
            _set_nodelay(client_writer)
            try:
                target_reader, target_writer = await asyncio.wait_for(
                    asyncio.open_connection(self.target_host, self.target_port, limit=2 * _CHUNK),
                    _CONNECT_TIMEOUT_S,
                )
            except (OSError, asyncio.TimeoutError) as e:
                logger.debug("delay proxy: cannot reach %s:%d: %r", self.target_host, self.target_port, e)
                return
            _set_nodelay(target_writer)
            ok = await _run_all(
                self._pipe(client_reader, target_writer),
                self._pipe(target_reader, client_writer),
            )
        except (OSError, EOFError) as e:  # pragma: no cover - defensive
            logger.debug("delay proxy connection failed: %r", e)
        finally:
            self._connections.discard(task)
            for writer in (client_writer, target_writer):
                if writer is None:
                    continue
                if ok:
                    writer.close()
                else:
                    writer.transport.abort()
            for writer in (client_writer, target_writer):
                if writer is not None:
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await writer.wait_closed()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction, each chunk ``delay`` after it was read, then forward EOF."""
        loop = asyncio.get_running_loop()
        line = _DelayLine(self.max_buffer_bytes)

        async def receive() -> None:
            while True:
                data = await reader.read(_CHUNK)
                await line.put(loop.time() + self.delay_ms / 1000.0, data)
                if not data:  # EOF travels through the queue, behind the bytes before it
                    return

        async def send() -> None:
            while True:
                due, data = await line.get()
                while (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof() and not writer.is_closing():
                        writer.write_eof()
                    await writer.drain()
                    return
                writer.write(data)
                await writer.drain()

        if not await _run_all(receive(), send()):
            raise ConnectionError("delay proxy: one side of the connection failed")


async def _run_all(*coros) -> bool:
    """Run coroutines concurrently; True if all finished, False (others cancelled) if one raised.

    Cancelling the caller cancels them all.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = any(not t.cancelled() and t.exception() is not None for t in done)
        if failed:
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    logger.debug("delay proxy: %r", t.exception())
        return not failed and not pending
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ThreadedDelayProxy:
    """A :class:`DelayProxy` on its own event loop in a daemon thread, for synchronous code.

    The server launcher uses this to put one proxy in front of each server's libp2p listen port.
    ``start()`` blocks until the port is bound (and re-raises a bind error); ``stop()`` closes every
    connection and joins the thread.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        delay_ms: float,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        *,
        max_buffer_bytes: int = _DEFAULT_MAX_BUFFER_BYTES,
    ):
        # Validate here, in the caller's thread, so bad arguments raise from the constructor.
        self._proxy_args = dict(
            target_host=target_host,
            target_port=target_port,
            delay_ms=delay_ms,
            listen_host=listen_host,
            listen_port=listen_port,
            max_buffer_bytes=max_buffer_bytes,
        )
        probe = DelayProxy(**self._proxy_args)
        self.listen_host = probe.listen_host
        self.listen_port = probe.listen_port
        self.target_host, self.target_port, self.delay_ms = target_host, int(target_port), float(delay_ms)
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop_event: Optional[asyncio.Event] = None
        self._started = threading.Event()
        self._error: Optional[BaseException] = None

    def start(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            raise RuntimeError("ThreadedDelayProxy already started")
        self._started.clear()
        self._error = None
        self._thread = threading.Thread(target=self._thread_main, name=f"delay-proxy->{self.target_port}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError("delay proxy thread did not start in time")
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise self._error

    def stop(self, timeout: float = 10.0) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        loop, stop_event = self._loop, self._stop_event
        if loop is not None and stop_event is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(stop_event.set)
        thread.join(timeout)

    def __enter__(self) -> "ThreadedDelayProxy":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _thread_main(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop_event = asyncio.Event()
            proxy = DelayProxy(**self._proxy_args)
            try:
                await proxy.start()
            except BaseException as e:
                self._error = e
                self._started.set()
                return
            self.listen_port = proxy.listen_port
            self._started.set()
            try:
                await self._stop_event.wait()
            finally:
                await proxy.stop()

        try:
            asyncio.run(main())
        except BaseException as e:  # pragma: no cover - surfaced through start() if early
            if not self._started.is_set():
                self._error = e
                self._started.set()
            else:
                logger.exception("delay proxy thread failed")
        finally:
            self._loop = None


def _parse_host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


async def _serve(args: argparse.Namespace) -> None:
    host, port = args.target
    async with DelayProxy(host, port, args.delay_ms, args.listen_host, args.listen_port) as proxy:
        print(
            f"delay proxy listening on {proxy.listen_host}:{proxy.listen_port} -> {host}:{port}, "
            f"{proxy.delay_ms:g} ms each way",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m swarm.delay_proxy",
        description="TCP proxy that adds a fixed one-way delay per direction (WAN emulation, loopback only).",
    )
    parser.add_argument("--target", required=True, type=_parse_host_port, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", required=True, type=float, help="one-way delay per direction, ms")
    parser.add_argument("--listen-host", default="127.0.0.1")
    parser.add_argument("--listen-port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args(argv)
    try:
        DelayProxy(args.target[0], args.target[1], args.delay_ms, args.listen_host, args.listen_port)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
