"""The agents by name (``mirror``, ``say``, ``talk``): what ``POST /sessions``' ``agent`` field picks."""

from __future__ import annotations

from cadence.errors import InputError
from cadence.serve.agent import Agent, MirrorAgent, SayAgent
from cadence.serve.converse import TalkAgent

AGENTS = ("mirror", "say", "talk")


def make_agent(name: str, chunk_seconds: float = 0.0, endpoint=None) -> Agent:
    """A new agent by name; ``chunk_seconds`` (the stream's chunk length) sizes the microphone backlog;
    ``endpoint`` (a :class:`cadence.serve.converse.AgentEndpoint`) is where ``talk`` sends each turn."""
    if name == "mirror":
        return MirrorAgent(chunk_seconds)
    if name == "say":
        return SayAgent()
    if name == "talk":
        return TalkAgent(endpoint)
    raise InputError(f"unknown agent {name!r}; choose one of {', '.join(AGENTS)}")
