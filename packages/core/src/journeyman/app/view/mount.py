"""The viewer inside `journeyman serve`: its pages and API at `/view/`, behind the server's API tokens
(`serving.guard`: scope train; a browser brings the API token once as `/view/?token=...` and gets a
viewer session of its own in an HttpOnly cookie, never the token)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response

from journeyman.app.view.api import handle
from journeyman.app.view.runs import RunFiles
from journeyman.serving.guard import VIEW_PREFIX

__all__ = ["add_viewer"]


def add_viewer(app: FastAPI, root: Path) -> None:
    """Serve the viewer over the runs under `root` (the server's `--path`) at `/view/`."""
    runs = RunFiles([root])
    # the model a run id's run is of, for the server's tenant rule (`backends/server.py: _PerToken`)
    app.state.view_run_model = lambda run_id: runs.get(run_id).name

    @app.get(VIEW_PREFIX, include_in_schema=False)
    async def view_root() -> RedirectResponse:
        return RedirectResponse(VIEW_PREFIX + "/", status_code=308)

    @app.get(VIEW_PREFIX + "/{path:path}", include_in_schema=False)
    async def view(path: str, request: Request) -> Response:
        # files read and JSON parsed on a worker thread: the event loop serves the models meanwhile
        res = await asyncio.to_thread(handle, runs, path, request.url.query)
        return Response(res.body, status_code=res.status, media_type=res.content_type, headers=res.headers)
