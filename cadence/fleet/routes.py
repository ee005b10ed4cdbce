"""A ``--ray`` front end's operator routes (the operator key, as ``GET /sessions``):

    GET    /fleet                       the registry's view: groups (state, node, claim, restarts), free, sessions
    POST   /fleet/groups/{name}/drain   drain a group: no new session on it; its live session finishes
    DELETE /fleet/groups/{name}/drain   admit sessions on it again

The server adds them beside its own (``create_app(..., routes=...)``: an ``ExtraRoutes`` of
``cadence.serve.ports``, given the app and its ``cadence.serve.guard.Access``).

(No ``from __future__ import annotations`` here: FastAPI reads the ``Request`` annotation at runtime.)
"""

from fastapi import Request

from cadence.serve.guard import ApiError, bearer


def fleet_routes(src):
    """``add(app, access)``: the routes of a front end whose groups come from ``src`` (a ``FleetGroups``)."""

    def add(app, access) -> None:
        add_fleet_routes(app, access, src)

    return add


def add_fleet_routes(app, access, src) -> None:
    """Add the routes to ``app``; ``access`` checks the operator key."""

    @app.get("/fleet", summary="The fleet: groups, their state, sessions, free capacity (operator key)")
    async def fleet(request: Request):
        access.require_operator(bearer(request), "the fleet's state")
        try:
            await src.sync()  # (fresh: an operator's view, not the last heartbeat's)
        except Exception as e:  # the registry is restarting: the last heartbeat's view, marked stale
            return {"frontend": src.frontend_id, "stale": f"{type(e).__name__}", **src.snapshot}
        return {"frontend": src.frontend_id, **src.snapshot}

    async def _drain(name: str, request: Request, on: bool) -> dict:
        access.require_operator(bearer(request), "draining a group")
        if not await src.drain(name, on):
            raise ApiError(404, f"no group {name!r} in the fleet")
        await src.sync()
        return {"group": name, "draining": on}

    @app.post("/fleet/groups/{name}/drain", summary="Drain a group: no new session; the live one finishes")
    async def drain(name: str, request: Request):
        return await _drain(name, request, True)

    @app.delete("/fleet/groups/{name}/drain", summary="Admit sessions on a drained group again")
    async def undrain(name: str, request: Request):
        return await _drain(name, request, False)
