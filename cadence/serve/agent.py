"""Agents: what the character says.

An :class:`Agent` takes audio in (the user's microphone, 48 kHz mono float32) and produces speech
audio out (48 kHz mono float32) in *segments*; the scheduler pulls one chunk's window of it at a
time (``take``), silence when the agent has nothing to say. ``interrupt()`` drops what is queued.

Each segment's first sample carries the host time (``time.monotonic()``) at which the agent had it:
``take`` returns the positions of segment starts inside the window, so the session can time
"agent first audio -> first speaking frame" through the pipeline.

Built-ins:

* ``mirror``: the user's own voice drives the mouth (microphone audio in = speech out).
* ``say``: typed text becomes speech through Debian's ``espeak-ng`` (a subprocess reading the text on
  stdin, never as an argument, and writing WAV to stdout), resampled to 48 kHz; the microphone is ignored.
"""

from __future__ import annotations

import collections
import shutil
import subprocess
import time
from dataclasses import dataclass

import numpy as np

from cadence.errors import InputError

SAMPLE_RATE = 48_000


@dataclass
class SegmentMark:
    offset: int  # sample position inside the taken window where a segment starts
    t_agent: float  # when the agent had this segment's first audio (time.monotonic())


class SampleQueue:
    """A FIFO of float32 samples with marked positions; keeps at most ``max_seconds`` (drops the oldest)."""

    def __init__(self, max_seconds: float):
        self.max_samples = int(max_seconds * SAMPLE_RATE)
        self._pieces: collections.deque[np.ndarray] = collections.deque()
        self._marks: collections.deque[tuple[int, float]] = collections.deque()  # (absolute sample, t)
        self.queued = 0
        self._head = 0  # absolute sample position of the queue's head
        self.dropped = 0

    def push(self, samples: np.ndarray, mark_t: float | None = None) -> None:
        samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        if samples.size == 0:
            return
        if mark_t is not None:
            self._marks.append((self._head + self.queued, mark_t))
        self._pieces.append(samples)
        self.queued += samples.size
        if self.queued > self.max_samples:
            self.drop(self.queued - self.max_samples)

    def take(self, n: int) -> tuple[np.ndarray, list[SegmentMark]]:
        """Up to ``n`` samples (fewer when fewer are queued) and the marks inside them."""
        n = min(n, self.queued)
        out = np.empty(n, np.float32)
        pos = 0
        while pos < n:
            p = self._pieces[0]
            k = min(n - pos, p.size)
            out[pos : pos + k] = p[:k]
            if k == p.size:
                self._pieces.popleft()
            else:
                self._pieces[0] = p[k:]
            pos += k
        marks = []
        while self._marks and self._marks[0][0] < self._head + n:
            at, t = self._marks.popleft()
            marks.append(SegmentMark(max(0, at - self._head), t))
        self._head += n
        self.queued -= n
        return out, marks

    def drop(self, count: int | None = None) -> None:
        count = self.queued if count is None else min(count, self.queued)
        self.dropped += count
        while count > 0:
            p = self._pieces[0]
            k = min(count, p.size)
            if k == p.size:
                self._pieces.popleft()
            else:
                self._pieces[0] = p[k:]
            count -= k
            self.queued -= k
            self._head += k
        while self._marks and self._marks[0][0] < self._head:
            self._marks.popleft()


class Agent:
    """Base: a queue of speech (``speak``) the character says, segment starts marked.

    ``take(n)`` is what the scheduler calls once per chunk: the next ``n`` samples of speech,
    padded with whatever ``_fill`` gives (the microphone for ``mirror``) and then silence.
    """

    name = "agent"
    #: Largest speech backlog kept (seconds); older speech is dropped so latency stays bounded.
    max_backlog_s = 60.0

    def __init__(self) -> None:
        self.speech = SampleQueue(self.max_backlog_s)
        self.segments = 0
        self.speaking_samples = 0

    def push_mic(self, samples: np.ndarray) -> None:
        """Microphone audio from the user (48 kHz mono float32). Ignored unless the agent uses it."""

    def speak(self, samples: np.ndarray, t_agent: float | None = None) -> None:
        """Queue one segment of speech (48 kHz mono float32); its first sample is marked with ``t_agent``
        (default: now) for the audio -> frame latency."""
        if np.asarray(samples).size == 0:
            return
        self.segments += 1
        self.speech.push(samples, time.monotonic() if t_agent is None else t_agent)

    def interrupt(self) -> None:
        """Stop speaking now: drop everything queued."""
        self.speech.drop()

    @property
    def queued_samples(self) -> int:
        return self.speech.queued

    def take(self, n: int) -> tuple[np.ndarray, list[SegmentMark]]:
        """The next ``n`` samples the character says (silence-padded) and the segment starts inside them."""
        out = np.zeros(n, np.float32)
        a, marks = self.speech.take(n)
        out[: a.size] = a
        if a.size < n:
            b, more = self._fill(n - a.size)
            out[a.size : a.size + b.size] = b
            marks += [SegmentMark(m.offset + a.size, m.t_agent) for m in more]
        self.speaking_samples += a.size
        return out, marks

    def _fill(self, n: int) -> tuple[np.ndarray, list[SegmentMark]]:
        return np.zeros(0, np.float32), []

    def close(self) -> None:
        self.interrupt()


class MirrorAgent(Agent):
    """The character lip-syncs the user's own microphone audio (and anything queued with ``speak``,
    which goes first).

    The microphone keeps a short backlog (0.5 s, or one chunk + 0.25 s when chunks are longer, as
    W1.3's 500 ms ones: the scheduler takes a whole chunk of it at once): audio that arrives faster
    than the stream plays is dropped rather than delayed. A voiced stretch after >= 0.3 s of quiet
    (RMS threshold) marks a segment start, so "first audio -> first speaking frame" is measured per
    utterance.
    """

    name = "mirror"
    mic_backlog_s = 0.5
    voice_rms = 0.01
    silence_reset_s = 0.3

    def __init__(self, chunk_seconds: float = 0.0) -> None:
        super().__init__()
        self.mic_backlog_s = max(type(self).mic_backlog_s, chunk_seconds + 0.25)
        self.mic = SampleQueue(self.mic_backlog_s)
        self._silent_for = float("inf")

    def push_mic(self, samples: np.ndarray) -> None:
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if samples.size == 0:
            return
        voiced = float(np.sqrt(np.mean(samples * samples))) > self.voice_rms
        start = voiced and self._silent_for >= self.silence_reset_s
        self._silent_for = 0.0 if voiced else self._silent_for + samples.size / SAMPLE_RATE
        if start:
            self.segments += 1
        self.mic.push(samples, time.monotonic() if start else None)

    def _fill(self, n: int) -> tuple[np.ndarray, list[SegmentMark]]:
        return self.mic.take(n)

    def interrupt(self) -> None:
        super().interrupt()
        if hasattr(self, "mic"):
            self.mic.drop()


class SayAgent(Agent):
    """Typed text -> speech through espeak-ng (a subprocess), resampled to 48 kHz."""

    name = "say"
    max_text = 1000

    def __init__(self, voice: str = "en", speed: int = 160) -> None:
        super().__init__()
        self.voice, self.speed = voice, speed

    def say(self, text: str) -> float:
        """Synthesize ``text`` and queue it; returns the speech length in seconds."""
        audio = synthesize(text, self.voice, self.speed)
        self.speak(audio, t_agent=time.monotonic())  # the agent's first audio exists from now
        return audio.size / SAMPLE_RATE


AGENTS = {"mirror": MirrorAgent, "say": SayAgent}


def make_agent(name: str, chunk_seconds: float = 0.0) -> Agent:
    """A new agent by name; ``chunk_seconds`` (the stream's chunk length) sizes the microphone backlog."""
    try:
        cls = AGENTS[name]
    except KeyError:
        raise InputError(f"unknown agent {name!r}; choose one of {', '.join(AGENTS)}") from None
    return cls(chunk_seconds) if cls is MirrorAgent else cls()


# ---- espeak-ng -----------------------------------------------------------------------------------


def espeak_binary() -> str | None:
    """Path of espeak-ng (or espeak), None when not installed."""
    return shutil.which("espeak-ng") or shutil.which("espeak")


class TTSUnavailable(RuntimeError):
    pass


def synthesize(text: str, voice: str = "en", speed: int = 160, timeout: float = 20.0) -> np.ndarray:
    """``text`` -> float32 mono 48 kHz through ``espeak-ng --stdout --stdin`` (WAV) and PyAV's resampler.

    The user's text reaches espeak-ng only as its standard input, so nothing in it can act as an option
    (``-f FILE`` would read a file of the server's). ``voice`` and ``speed`` are the server's own.
    ``InputError`` for empty, too long, NUL-carrying or unencodable text."""
    text = " ".join(str(text).split())
    if not text:
        raise InputError("text to say is empty")
    if len(text) > SayAgent.max_text:
        raise InputError(f"text to say is too long ({len(text)} characters; limit {SayAgent.max_text})")
    exe = espeak_binary()
    if exe is None:
        raise TTSUnavailable(
            "the 'say' agent needs espeak-ng, which is not installed on the server "
            "(Debian: apt-get install espeak-ng)"
        )
    if "\0" in text:
        raise InputError("text to say contains a NUL character")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError("text to say is not valid Unicode (a lone surrogate?)") from None
    try:
        # The text goes in on stdin, never on the command line: argv is espeak-ng's option space, and text
        # such as "-f/etc/shadow" there would be an option (read that file and say it).
        out = subprocess.run(
            [exe, "-v", voice, "-s", str(int(speed)), "--stdout", "--stdin"],
            input=data,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise TTSUnavailable(f"espeak-ng did not finish within {timeout:.0f} s") from None
    if out.returncode != 0 or not out.stdout:
        msg = out.stderr.decode(errors="replace").strip() or f"exit status {out.returncode}"
        raise TTSUnavailable(f"espeak-ng failed: {msg}")
    return decode_audio_bytes(out.stdout)


def decode_audio_bytes(data: bytes, max_seconds: float = 60.0) -> np.ndarray:
    """Any audio file FFmpeg decodes (bytes) -> float32 mono 48 kHz. ``InputError`` when it is not audio."""
    import io

    import av

    if not data:
        raise InputError("audio is empty (0 bytes)")
    pieces = []
    have = 0
    limit = int(max_seconds * SAMPLE_RATE)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise InputError("no audio stream in the uploaded data")
            stream = container.streams.audio[0]
            res = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(stream):
                for o in res.resample(frame):
                    pieces.append(o.to_ndarray().reshape(-1))
                    have += pieces[-1].size
                if have > limit:
                    raise InputError(f"audio is too long (over {max_seconds:.0f} s)")
            for o in res.resample(None):
                pieces.append(o.to_ndarray().reshape(-1))
    except InputError:
        raise
    except Exception as e:
        raise InputError(
            f"could not decode audio ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from None
    samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    if samples.size == 0:
        raise InputError("audio contains no samples")
    return np.clip(samples, -1.0, 1.0).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = SAMPLE_RATE) -> bytes:
    """float32 mono -> 16-bit PCM WAV bytes (clients and tests)."""
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()
