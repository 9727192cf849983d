"""The task server of ``env=browser``: stdlib ``http.server`` on 127.0.0.1 in a thread,
serving every episode's site under its own token and recording what each one submits.

    GET  /s/<token>/p/<page>        the page's HTML (sites.page_html)
    POST /s/<token>/submit/<page>   a form submission: recorded; a passed gate answers
                                    303 to its next page, anything else is final
    anything else                   404

What an episode's grade reads (:meth:`TaskServer.final`) is only what this server
received, never the policy's text.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, unquote

from asyncrl.envs.browser.sites import Site, page_html, submission_outcome

MAX_BODY = 64 * 1024  # a submission larger than this is refused (413)


@dataclass
class Record:
    """One site's state on the server."""

    site: Site
    submissions: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    final: tuple[str, dict[str, str]] | None = None  # the first final submission


class QuietServer(ThreadingHTTPServer):
    """The stdlib's threading server, silent about a client that hung up mid-answer (a
    browser context closed while its page or favicon was being sent): that is an
    episode ending, not a server fault. Any other error is printed as the stdlib does."""

    def handle_error(self, request: object, client_address: object) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class TaskServer:
    """Sites by token; thread-safe. ``port``: the loopback port it listens on."""

    def __init__(self) -> None:
        self._sites: dict[str, Record] = {}
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"server_state": self})
        self._httpd = QuietServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="browser-task-server", daemon=True
        )
        self._thread.start()

    def url(self, token: str, page: str) -> str:
        return f"{self.prefix(token)}p/{page}"

    def prefix(self, token: str) -> str:
        """Every URL of the site of ``token`` starts with this."""
        return f"http://127.0.0.1:{self.port}/s/{token}/"

    def add(self, token: str, site: Site) -> None:
        with self._lock:
            self._sites[token] = Record(site)

    def remove(self, token: str) -> None:
        with self._lock:
            self._sites.pop(token, None)

    def record(self, token: str) -> Record | None:
        with self._lock:
            return self._sites.get(token)

    def final(self, token: str) -> tuple[str, dict[str, str]] | None:
        rec = self.record(token)
        return None if rec is None else rec.final

    def submit(self, token: str, page: str, fields: dict[str, str]) -> str | None:
        """Record a submission; the next page's name, or None when it is final (or the
        token or page is unknown)."""
        with self._lock:
            rec = self._sites.get(token)
            if rec is None or page not in rec.site["pages"] or rec.final is not None:
                return None
            rec.submissions.append((page, fields))
            nxt = submission_outcome(rec.site, page, fields)
            if nxt is None:
                rec.final = (page, fields)
            return nxt

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    server_state: TaskServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
        pass

    def _parts(self) -> tuple[str, str, str] | None:
        parts = self.path.split("?", 1)[0].strip("/").split("/")
        if len(parts) != 4 or parts[0] != "s":
            return None
        return parts[1], parts[2], unquote(parts[3])

    def _send(self, code: int, body: str = "", location: str = "") -> None:
        data = body.encode()
        self.send_response(code)
        if location:
            self.send_header("Location", location)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        parts = self._parts()
        rec = None if parts is None else self.server_state.record(parts[0])
        if parts is None or rec is None or parts[1] != "p" or parts[2] not in rec.site["pages"]:
            return self._send(404, "not found")
        token, _, page = parts
        self._send(200, page_html(rec.site, page, f"/s/{token}/submit/{page}"))

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        parts = self._parts()
        size = int(self.headers.get("Content-Length") or 0)
        if parts is None or parts[1] != "submit" or size > MAX_BODY:
            return self._send(404 if size <= MAX_BODY else 413, "refused")
        fields = dict(parse_qsl(self.rfile.read(size).decode("utf-8", "replace")))
        token, _, page = parts
        nxt = self.server_state.submit(token, page, fields)
        if nxt is not None:
            return self._send(303, "", f"/s/{token}/p/{nxt}")
        self._send(200, "<!doctype html><html><body><p>Submitted.</p></body></html>")
