"""The server's web page: a chat playground and a live view of the engine, at ``GET /``.

The page is static (``static/``: HTML, CSS and ES modules, no build step, nothing loaded from
elsewhere). It needs no new endpoint: it streams from ``/v1/chat/completions``, polls the open
``/metrics`` and ``/health``, and finds out whether the server wants an API key from the answer
of ``/v1/models`` (401). The page and its files are served without the key, like ``/metrics``:
they hold no secret, and the page asks the person for the key and sends it with API calls.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response

STATIC_DIR = Path(__file__).parent / "static"
STATIC_PATH = "/static"

CONTENT_SECURITY_POLICY = "; ".join([
    # Everything from this server only: no CDN, and an injected script could not send the
    # API key anywhere else.
    "default-src 'self'",
    "img-src 'self' data:",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])
"""Sent with the page. Its scripts and styles are files (no inline code), so this holds."""

PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "Cache-Control": "no-cache",  # revalidate (ETag) so an upgraded server's page is seen
    "X-Content-Type-Options": "nosniff",
}


class _RevalidatedStaticFiles(StaticFiles):
    """Static files that the browser revalidates (ETag) before each use."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


def add_web_routes(app: FastAPI) -> None:
    """Serve the page at ``GET /`` and its files under ``/static/``, both without the API key.

    Neither route is in ``/openapi.json``: the schema describes the API only.
    """
    index = STATIC_DIR / "index.html"
    if not index.is_file():
        raise ValueError(f"static: the web page is missing ({index}); reinstall pagedserve")
    app.mount(STATIC_PATH, _RevalidatedStaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def web_page() -> FileResponse:
        return FileResponse(index, media_type="text/html", headers=PAGE_HEADERS)
