"""uvicorn's httptools protocol with the two limits it lacks: a deadline for a request's headers (a
client sending a byte a second holds no connection for long: 408) and a bound on their size (431).
"""
from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _Refused(Exception):
    pass


def guarded_protocol(header_timeout_s: float, max_header_bytes: int) -> type:
    class GuardedHttp(HttpToolsProtocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._refused: tuple[int, str] | None = None
            self._header_bytes = 0
            self._header_timer = None
            self._arm()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self._refuse(408, f"the request's headers did not arrive within {header_timeout_s:g} s")

        def _refuse(self, status: int, message: str) -> None:
            body = message.encode()
            reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (status, reason, len(body), body))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused is None:
                if self.cycle is None or self.cycle.response_complete:
                    self._arm()  # a new request's first bytes (a kept-alive connection's too)
                super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            if self._refused is not None:
                return self._refuse(*self._refused)
            super().send_400_response(msg)

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > max_header_bytes:
                self._disarm()
                self._refused = (431, f"the request's headers are over {max_header_bytes} bytes")
                raise _Refused  # the parser stops; send_400_response above answers 431

        def on_headers_complete(self) -> None:
            self._disarm()
            self._header_bytes = 0
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedHttp
