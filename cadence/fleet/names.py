"""The fleet's Ray names (a module of their own: the registry and the config both read them)."""

#: The Ray namespace every fleet actor lives in (named actors are looked up inside it).
NAMESPACE = "cadence"
#: The registry's actor name; the groups are ``<GROUP_PREFIX><index>``.
REGISTRY_NAME = "cadence-registry"
GROUP_PREFIX = "cadence-group-"
