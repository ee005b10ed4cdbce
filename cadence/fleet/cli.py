"""``cadence fleet status|drain|undrain|down --ray ADDRESS``: an operator's view of a fleet's registry,
straight through Ray (no front end needed). ``GET /fleet`` and ``POST /fleet/groups/{name}/drain`` on any
front end do the same over HTTP."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    f = sub.add_parser(
        "fleet",
        help="a Ray fleet's groups: status, drain, undrain, down",
        description="Talk to the fleet registry of a Ray cluster (cadence serve --ray): list its groups, "
        "drain one (no new sessions; the live one finishes), undrain it, or tear the fleet down.",
    )
    f.add_argument("action", choices=["status", "drain", "undrain", "down"])
    f.add_argument(
        "group", nargs="?", default=None, help="the group (e.g. cadence-group-0) for drain/undrain"
    )
    f.add_argument("--ray", default="auto", metavar="auto|ADDRESS", help="the Ray cluster (default: auto)")
    f.set_defaults(func=cmd_fleet)


def cmd_fleet(args: argparse.Namespace) -> int:
    from cadence.errors import InputError

    try:
        import ray
    except ModuleNotFoundError:
        raise InputError("'cadence fleet' needs the ray extra: pip install 'cadence[ray]'") from None
    from cadence.fleet.config import NAMESPACE, REGISTRY_NAME

    if args.action in ("drain", "undrain") and not args.group:
        raise InputError(f"cadence fleet {args.action} needs a group name (see: cadence fleet status)")
    ray.init(address=args.ray, namespace=NAMESPACE, logging_level="warning", log_to_driver=False)
    try:
        try:
            reg = ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
        except ValueError:
            raise InputError(f"no cadence fleet on the Ray cluster at {args.ray}") from None
        if args.action == "status":
            print(json.dumps(ray.get(reg.snapshot.remote(), timeout=30), indent=1))
        elif args.action == "down":
            ray.get(reg.remove_all.remote(), timeout=120)
            ray.kill(reg, no_restart=True)
            print("fleet removed (groups stopped, their placement groups removed, registry killed)")
        else:
            if not ray.get(reg.drain.remote(args.group, args.action == "drain"), timeout=30):
                raise InputError(f"no group {args.group!r} in the fleet")
            print(f"{args.group}: {'draining' if args.action == 'drain' else 'admitting sessions'}")
    finally:
        ray.shutdown()
    return 0
