"""Routes serving the playground page: `/` and its two assets, read from this package at import.

The paths are fixed (no path parameter), so no request names a file; anything else under `/playground/`
is the usual 404 envelope. The three paths are open without an API key (security.OPEN_PATHS): the page
holds no secret, and it asks for the key itself when the API answers 401.
"""
from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

PAGES = {  # route -> (file in this package, media type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/playground/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/playground/style.css": ("style.css", "text/css; charset=utf-8"),
}
PATHS = frozenset(PAGES)

router = APIRouter()


def _page(name: str, media_type: str):
    body = files(__package__).joinpath(name).read_bytes()

    async def page() -> Response:
        # the page may not be framed by other sites, and loads nothing from elsewhere
        return Response(body, media_type=media_type, headers={
            "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"})
    return page


for _path, (_name, _type) in PAGES.items():
    router.add_api_route(_path, _page(_name, _type), methods=["GET"], include_in_schema=False)
