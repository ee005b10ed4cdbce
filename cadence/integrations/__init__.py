"""Cadence inside other frameworks (optional extras): ``cadence.integrations.pipecat``."""
