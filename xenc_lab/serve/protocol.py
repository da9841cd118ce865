"""uvicorn's h11 connection with a deadline on request heads and counted timeouts: uvicorn closes a connection left idle
after an answer (``timeout_keep_alive``) but waits forever for the head of a request on a new connection, or for the
rest of a head that trickles in (slowloris); here a connection with no whole request head ``head_timeout`` seconds after
it opened (or after its last answer, plus the keep-alive time) gets 408 and is closed. Both kinds are counted."""
from __future__ import annotations

import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body


def timed_protocol(metrics, head_timeout: float) -> type[H11Protocol]:
    """An H11Protocol class reporting to ``metrics`` (a Metrics) and closing connections whose head is late."""
    body = json.dumps(error_body(408, f"no whole request head within {head_timeout:g} s")).encode()
    late = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    class TimedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm(head_timeout)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(self.timeout_keep_alive + head_timeout)

        def _arm(self, seconds: float) -> None:
            if (timer := getattr(self, "_head_timer", None)) is not None:
                timer.cancel()
            waiting_after = self.cycle  # the request answered last (None: none yet)
            self._head_timer = self.loop.call_later(seconds, self._head_late, waiting_after)

        def connection_lost(self, exc) -> None:
            if (timer := getattr(self, "_head_timer", None)) is not None:
                timer.cancel()
            super().connection_lost(exc)

        def _head_late(self, waiting_after) -> None:
            if self.cycle is not waiting_after or self.transport.is_closing():
                return  # a request came (or the connection is gone)
            metrics.timeouts.labels("headers").inc()
            self.transport.write(late)
            self.transport.close()

        def timeout_keep_alive_handler(self) -> None:
            if not self.transport.is_closing():
                metrics.timeouts.labels("keep_alive").inc()
            super().timeout_keep_alive_handler()

    return TimedH11
