"""The ``talk`` agent: each user turn answered by an OpenAI-compatible LLM (and optionally its STT / TTS).

Turn-taking (voice activity, end of turn, barge-in) is :class:`cadence.serve.agent.TurnTakingAgent`'s:
the user's microphone goes through an energy VAD in 20 ms blocks; the end of a turn is the last voiced
block once ``stop_s`` of quiet follow; the user's voice while the character speaks is a barge-in (queued
speech dropped, the audio of chunks planned but not yet played silenced).

The ``talk`` agent answers each turn through an OpenAI-compatible HTTP API (llama.cpp's server, vLLM,
Ollama, or a cloud one): the user's audio of the turn -> ``POST {url}/audio/transcriptions`` (only when
an STT model is configured; otherwise the LLM is told how long the user spoke) -> ``POST
{url}/chat/completions`` -> ``POST {url}/audio/speech`` (when a TTS model is configured; otherwise
espeak-ng on the server). Every hop is timed from the user's end of speech (``turns`` in the session
report). An endpoint that is missing, refuses or times out gives one clear error, shown on the page
(``agent_error`` in the session status) and kept in the report; the stream keeps running and the next
turn tries again.

Nothing here imports torch (the web process never does); ``httpx`` is the HTTP client.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import numpy as np

from cadence.errors import InputError
from cadence.serve.agent import (
    Turn,
    TurnTakingAgent,
    decode_audio_bytes,
    espeak_binary,
    synthesize,
    wav_bytes,
)

# ---- the OpenAI-compatible endpoint ---------------------------------------------------------------


class AgentEndpointError(RuntimeError):
    """The agent's endpoint failed (unreachable, refused, timed out, an unexpected reply)."""


@dataclass
class AgentEndpoint:
    """Where the ``talk`` agent's LLM (and optionally STT / TTS) run: an OpenAI-compatible API.

    ``url`` is the API base (``http://127.0.0.1:8080/v1`` for llama.cpp's server, ``.../v1`` for vLLM
    and Ollama); the key, if any, is read from the environment variable ``api_key_env`` (never a flag
    value, which would show in ``ps``)."""

    url: str
    model: str = "default"
    api_key_env: str | None = "CADENCE_AGENT_API_KEY"
    system_prompt: str = (
        "You are a friendly character in a live video call. Answer in one or two short spoken sentences."
    )
    stt_model: str | None = None
    tts_model: str | None = None
    tts_voice: str = "alloy"
    timeout_s: float = 20.0
    max_history: int = 12

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise InputError(f"the agent endpoint must be an http(s) URL, got {self.url!r}")
        self.url = self.url.rstrip("/")

    def headers(self) -> dict:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _post(self, client, path: str, what: str, **kw):
        import httpx

        try:
            r = await client.post(f"{self.url}{path}", headers=self.headers(), timeout=self.timeout_s, **kw)
        except httpx.TimeoutException:
            where = f"{self.url}{path}"
            raise AgentEndpointError(
                f"{what}: {where} did not answer within {self.timeout_s:.0f} s"
            ) from None
        except httpx.HTTPError as e:
            raise AgentEndpointError(
                f"{what}: cannot reach {self.url}{path} ({type(e).__name__}: {e})"
            ) from None
        if r.status_code != 200:
            raise AgentEndpointError(f"{what}: {self.url}{path} answered {r.status_code}: {r.text[:200]!r}")
        return r

    async def transcribe(self, client, audio: np.ndarray) -> str:
        files = {"file": ("turn.wav", wav_bytes(audio), "audio/wav")}
        r = await self._post(
            client, "/audio/transcriptions", "speech-to-text", files=files, data={"model": self.stt_model}
        )
        try:
            return str(r.json()["text"]).strip()
        except (ValueError, KeyError, TypeError):
            raise AgentEndpointError(f"speech-to-text: unexpected reply {r.text[:200]!r}") from None

    async def chat(self, client, messages: list[dict]) -> str:
        body = {"model": self.model, "messages": messages, "stream": False}
        r = await self._post(client, "/chat/completions", "LLM", json=body)
        try:
            return str(r.json()["choices"][0]["message"]["content"] or "").strip()
        except (ValueError, KeyError, IndexError, TypeError):
            raise AgentEndpointError(f"LLM: unexpected reply {r.text[:200]!r}") from None

    async def speech(self, client, text: str) -> np.ndarray:
        body = {"model": self.tts_model, "input": text, "voice": self.tts_voice, "response_format": "wav"}
        r = await self._post(client, "/audio/speech", "text-to-speech", json=body)
        try:
            return decode_audio_bytes(r.content)
        except InputError as e:
            raise AgentEndpointError(f"text-to-speech: {e}") from None


# ---- the talk agent ---------------------------------------------------------------------------------


class TalkAgent(TurnTakingAgent):
    """Talk to the character: each turn goes to an OpenAI-compatible endpoint (see the module doc)."""

    name = "talk"

    def __init__(self, endpoint: AgentEndpoint | None, voice: str = "en", speed: int = 160) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.voice, self.speed = voice, speed
        self.history: list[dict] = []
        self._client = None

    async def answer(self, turn: Turn, audio: np.ndarray) -> None:
        import httpx

        ep = self.endpoint
        if ep is None:
            raise AgentEndpointError("the 'talk' agent has no endpoint (cadence serve --agent-url URL)")
        if self._client is None:
            self._client = httpx.AsyncClient()
        t0 = turn.t_end
        if ep.stt_model:
            turn.transcript = await ep.transcribe(self._client, audio)
            turn.stt_ms = (time.monotonic() - t0) * 1e3
            user = turn.transcript or "(inaudible)"
        else:
            user = f"(the user spoke for {turn.user_s:.1f} s; no speech-to-text is configured)"
        self.history.append({"role": "user", "content": user})
        messages = [{"role": "system", "content": ep.system_prompt}, *self.history[-ep.max_history :]]
        t1 = time.monotonic()
        turn.reply = await ep.chat(self._client, messages)
        turn.llm_ms = (time.monotonic() - t1) * 1e3
        self.history.append({"role": "assistant", "content": turn.reply})
        if not turn.reply:
            return
        t2 = time.monotonic()
        if ep.tts_model:
            speech = await ep.speech(self._client, turn.reply)
        else:
            if espeak_binary() is None:
                raise AgentEndpointError("no TTS: set --agent-tts-model or install espeak-ng on the server")
            speech = await asyncio.get_running_loop().run_in_executor(
                None, synthesize, turn.reply[:1000], self.voice, self.speed
            )
        turn.tts_ms = (time.monotonic() - t2) * 1e3
        self.say_now(turn, speech)

    def close(self) -> None:
        super().close()
        client, self._client = self._client, None
        if client is not None:
            try:
                asyncio.get_running_loop().create_task(client.aclose())
            except RuntimeError:
                pass
