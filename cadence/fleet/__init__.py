"""Many sessions over many GPUs and machines, on Ray (``cadence serve --ray auto|ADDRESS``; ``pip install
'cadence[ray]'``); docs/fleet.md is the guide.

* :mod:`cadence.fleet.config`    what a front end joins (``FleetConfig``): plain data, no Ray.
* :mod:`cadence.fleet.state`     the registry's rules (groups, claims, leases, node loss, draining): no Ray.
* :mod:`cadence.fleet.group`     a worker group as a Ray actor: the single-machine ``WorkerGroup`` on its node.
* :mod:`cadence.fleet.registry`  the registry actor: builds the groups (STRICT_PACK placement groups), checks them.
* :mod:`cadence.fleet.frontend`  a front end's group source (``FleetGroups``); :mod:`cadence.fleet.routes` ``/fleet``.
* :mod:`cadence.fleet.media`     ``--fleet-media group``: WebRTC ends in the group actor (``MediaHost``: the same
  ``LiveSession`` on a loop of its own); :mod:`cadence.fleet.remote` the front end's side of such a session;
  :mod:`cadence.fleet.messages` what the two say to each other (dataclasses).
* :mod:`cadence.fleet.cluster`   a local Ray cluster of ``ray start`` processes (tests, ``bench serve --ray``).
* :mod:`cadence.fleet.capacity`  how many GPUs a load needs (a simulation).

Imports Ray only in the modules that need it; the front end (web process) imports no torch; a group actor
imports aiortc only when a session's WebRTC ends there.
"""
