"""A reward service sluice can score with (``producer.reward_url``): a tiny aiohttp server, runnable as is.

    python examples/reward_server.py --port 8900            # then, in the recipe:

    [producer]
    reward_url = "http://127.0.0.1:8900/score"

With ``--token-env SLUICE_REWARD_TOKEN`` it requires ``Authorization: Bearer <that variable's value>``, which the
recipe sends without writing the token anywhere::

    reward_headers = {Authorization = "env:SLUICE_REWARD_AUTH"}   # SLUICE_REWARD_AUTH="Bearer <token>"

The protocol (docs/plugins.md): one POST per prompt group,
``{"prompt_id", "prompt", "prompt_ids", "answer", "responses": [...]}`` -> ``{"rewards": [...], "infos": [...]}``.
A 5xx answer (or no answer) is retried by sluice with backoff; a 4xx is not. A real reward-model server would batch
the group through its model where this one compares strings.
"""

from __future__ import annotations

import argparse
import os

from aiohttp import web


def score(answer: str | None, responses: list[str]) -> tuple[list[float], list[dict[str, object]]]:
    """1 for a response whose first line is the answer, 0 otherwise (what a reward model would compute)."""
    got = [r.split("\n", 1)[0].strip() for r in responses]
    passed = [answer is not None and g == answer.strip() for g in got]
    return [float(p) for p in passed], [{"pass": p} for p in passed]


def make_app(token: str | None = None) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        if token is not None and request.headers.get("Authorization") != f"Bearer {token}":
            return web.json_response({"error": "unauthorized"}, status=401)
        try:
            body = await request.json()
            responses = [str(r) for r in body["responses"]]
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "expected {'responses': [...], 'answer': ...}"}, status=400)
        rewards, infos = score(body.get("answer"), responses)
        return web.json_response({"rewards": rewards, "infos": infos})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/score", handle)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8900)
    parser.add_argument("--token-env", default=None, help="environment variable holding the bearer token to require")
    args = parser.parse_args()
    token = os.environ[args.token_env] if args.token_env else None
    web.run_app(make_app(token), host=args.host, port=args.port, print=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
