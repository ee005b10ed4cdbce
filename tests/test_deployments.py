"""Where the worker groups run: a typed :class:`~cadence.engine.placement.Placement` per group, and a named
deployment (``cadence serve --deploy local|ray``: ``cadence.serve.config.DEPLOYMENTS``) that the server asks
for its groups, their source and its routes, with no ``if`` on which one it is."""

from __future__ import annotations

import argparse

import pytest

from cadence.engine.placement import Placement
from cadence.engine.recipe import EngineSpec, resolve
from cadence.errors import ConfigError
from cadence.serve.config import (
    DEPLOYMENTS,
    LOCAL,
    DeploymentKind,
    ServeConfig,
    add_deployment_flags,
    deployment_from_args,
    serve_groups,
)


def test_a_placement_is_checked_once_and_prints_as_the_text_it_was():
    p = Placement.of("cuda:0+cuda:1")
    assert (
        p.devices == ("cuda:0", "cuda:1")
        and str(p) == "cuda:0+cuda:1"
        and (p.kind, p.ranks, p.gpus)
        == (
            "cuda",
            2,
            2,
        )
    )
    assert Placement.of(p) is p and Placement.of(["cpu", "cpu"]).gpus == 0 and p.holds_gpu(1)
    for bad in ("gpu:0", "cuda:0+cpu", "cuda:1+cuda:1", "", "cuda:0+"):
        with pytest.raises(ConfigError):
            Placement.of(bad)
    assert serve_groups("cuda", 2, None, 5, decode_gpu=0) == (
        Placement.of("cuda:1+cuda:2"),
        Placement.of("cuda:3+cuda:4"),
    )
    assert serve_groups("cpu", 2, 3) == (Placement.of("cpu+cpu"),) * 3
    # the config reads text into placements; the recipe records the text
    cfg = ServeConfig(groups=("cpu+cpu",))
    assert cfg.groups == (Placement(("cpu", "cpu")),)
    r = resolve(EngineSpec(model="tiny"), cfg.groups[0])
    assert (
        r.device == "cpu+cpu"
        and r.placement == cfg.groups[0]
        and r.describe(env={}).as_dict()["device"] == "cpu+cpu"
    )


def _words(*argv):
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp", type=int, default=1)
    add_deployment_flags(p)
    return p.parse_args(list(argv))


def test_the_deployment_is_chosen_by_name():
    from cadence.fleet.config import FleetConfig

    assert deployment_from_args(_words()) is LOCAL and ServeConfig().deployment is LOCAL
    ray = deployment_from_args(_words("--ray", "10.0.0.5:6379", "--device", "cuda", "--tp", "2"))
    assert isinstance(ray, FleetConfig) and ray.name == "ray" and ray.address == "10.0.0.5:6379"
    assert ray.placements("cuda", 2, None, None) == (Placement.of("cuda:0+cuda:1"),)
    assert deployment_from_args(_words("--deploy", "ray")).address == "auto"
    assert LOCAL.placements("cpu", 1, 2, None) == (Placement.of("cpu"),) * 2 and LOCAL.routes(None) == []
    with pytest.raises(SystemExit):
        _words("--deploy", "k8s")


def test_the_next_orchestrator_is_one_registry_entry(monkeypatch):
    """A deployment registered by name is a choice of --deploy, built from the words; the server asks it for
    its placements, group source and routes (nothing in serve names it)."""
    made = []

    class Elsewhere:
        name = "elsewhere"

        def placements(self, device, tp, max_sessions, decode_gpu):
            return (Placement.of("cpu"),)

        def group_source(self, cfg):
            made.append(cfg)
            return "its source"

        def routes(self, source):
            return []

    monkeypatch.setitem(globals(), "ELSEWHERE", Elsewhere())
    kind = DeploymentKind("elsewhere", "a test orchestrator", f"{__name__}:_elsewhere")
    monkeypatch.setitem(DEPLOYMENTS, "elsewhere", kind)
    d = deployment_from_args(_words("--deploy", "elsewhere"))
    assert d.name == "elsewhere"
    from cadence.serve.manager import group_source

    cfg = ServeConfig(deployment=d, groups=d.placements("cpu", 1, None, None))
    assert group_source(cfg) == "its source" and made == [cfg]


def _elsewhere(args):
    return globals()["ELSEWHERE"]
