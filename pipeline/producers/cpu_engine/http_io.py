"""The JSON in and out of the CPU engine's handlers, shared by ``server.py`` (generation) and ``weight_routes.py``
(weight updates), which is why it is in neither: ``server.py`` imports ``weight_routes.py``."""

from __future__ import annotations

from typing import Any

from aiohttp import web


def reply(success: bool, message: str, status: int | None = None) -> web.Response:
    """SGLang's ``{"success", "message"}`` answer; a failure is a 400 unless ``status`` says otherwise."""
    return web.json_response({"success": success, "message": message}, status=status or (200 if success else 400))


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object ({} for an empty body); a 400 for anything else."""
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise web.HTTPBadRequest(text=f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=f"the request body must be a JSON object, got {type(body).__name__}")
    return body
