"""Agents: what the character says.

An :class:`Agent` takes audio in (the user's microphone, 48 kHz mono float32) and produces speech
audio out (48 kHz mono float32) in *segments*; the scheduler pulls one chunk's window of it at a
time (``take``), silence when the agent has nothing to say. ``interrupt()`` drops what is queued.

Each segment's first sample carries the host time (``time.monotonic()``) at which the agent had it:
``take`` returns the positions of segment starts inside the window, so the session can time them through
the pipeline, as two measures with two names: ``agent_audio_to_frame_ms`` from speech the character was
given (an upload, ``/say``, a TTS reply, Pipecat's TTS: when the server had it) to the first frame of it
sent, and ``mic_to_frame_ms`` from a voiced stretch of the user's microphone (when its first 20 ms reached
the server) to the first frame ``mirror`` mouths it on, which adds the microphone backlog the agent keeps.

Every sample an agent queues is finite and within [-1, 1] (``speak`` refuses NaN and infinity:
``cadence.media.pcm``); the session cleans the microphone's before ``push_mic``.

Built-ins:

* ``mirror``: the user's own voice drives the mouth (microphone audio in = speech out).
* ``say``: typed text becomes speech through Debian's ``espeak-ng`` (a subprocess reading the text on
  stdin, never as an argument, and writing WAV to stdout), resampled to 48 kHz; the microphone is ignored.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from cadence.errors import InputError
from cadence.media.pcm import require_finite

SAMPLE_RATE = 48_000
log = logging.getLogger("cadence.serve")


@dataclass
class SegmentMark:
    offset: int  # sample position inside the taken window where a segment starts
    t_agent: float  # when the agent had this segment's first audio (time.monotonic())
    #: what started: "speech" (what the character was given to say: an upload, /say, a TTS reply, Pipecat's
    #: TTS) or "mic" (a voiced stretch of the user's microphone that ``mirror`` mouths): two latencies, two
    #: names (``speech_to_frame`` / ``mic_to_frame`` in the session's status)
    kind: str = "speech"


class SampleQueue:
    """A FIFO of float32 samples with marked positions; keeps at most ``max_seconds`` (drops the oldest)."""

    def __init__(self, max_seconds: float, kind: str = "speech"):
        self.max_samples = int(max_seconds * SAMPLE_RATE)
        self.kind = kind  # what its marks start (``SegmentMark.kind``)
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
            marks.append(SegmentMark(max(0, at - self._head), t, self.kind))
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

    def speak(self, samples: np.ndarray, t_agent: float | None = None, new_segment: bool = True) -> None:
        """Queue speech (48 kHz mono float32, clipped to [-1, 1]; ``NonFiniteAudio`` and nothing queued when any
        sample is NaN or infinite). ``new_segment``: it starts an utterance, whose first sample is marked with
        ``t_agent`` (default: now) for the speech -> frame latency; False: it continues the last one (a TTS
        streaming an utterance in pieces)."""
        if np.asarray(samples).size == 0:
            return
        samples = require_finite(samples, "speech")  # NonFiniteAudio: NaN would blank the video
        if new_segment:
            self.segments += 1
        mark = (time.monotonic() if t_agent is None else t_agent) if new_segment else None
        self.speech.push(samples, mark)

    #: Called after an interrupt (the session sets it: silence the audio of chunks planned, not yet played).
    on_interrupt = None

    def interrupt(self) -> None:
        """Stop speaking now: drop everything queued (and tell the session)."""
        self.speech.drop()
        if self.on_interrupt is not None:
            self.on_interrupt()

    #: A coroutine function the session runs as the agent's task (None: the agent needs none).
    run = None

    def status_fields(self) -> dict:
        """What the agent adds to the session's status (the page shows it)."""
        return {}

    def report_fields(self) -> dict:
        """What the agent adds to the session's report."""
        return {}

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
            marks += [SegmentMark(m.offset + a.size, m.t_agent, m.kind) for m in more]
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
        self.mic = SampleQueue(self.mic_backlog_s, kind="mic")
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


# ---- turn-taking (VAD, end of turn, barge-in) -------------------------------------------------

BLOCK = SAMPLE_RATE // 50  # 20 ms


class VoiceActivity:
    """Energy voice-activity detection with hysteresis, in 20 ms blocks of 48 kHz mono float32.

    ``push(samples)`` returns the events the new audio completes: ``("start", t)`` once ``start_s`` of
    consecutive voiced blocks (RMS > ``threshold``) are in, ``("stop", t)`` once ``stop_s`` of quiet
    blocks follow; ``t`` is the stream time (seconds of audio pushed so far) at the first voiced block
    of the run (start) or just after the last voiced block (stop: the user's end of speech)."""

    def __init__(self, threshold: float = 0.01, start_s: float = 0.08, stop_s: float = 0.5):
        if not (threshold > 0 and start_s > 0 and stop_s > 0):
            raise ValueError("threshold, start_s and stop_s must be positive")
        self.threshold, self.start_s, self.stop_s = threshold, start_s, stop_s
        self.speaking = False
        self._pending = np.zeros(0, np.float32)
        self._t = 0.0  # seconds of audio consumed
        self._run_start: float | None = None  # first voiced block of the current voiced run
        self._voiced_s = 0.0
        self._quiet_s = 0.0
        self._last_voiced_end = 0.0

    @property
    def stream_s(self) -> float:
        return self._t

    def push(self, samples: np.ndarray) -> list[tuple[str, float]]:
        x = np.concatenate([self._pending, np.asarray(samples, np.float32).reshape(-1)])
        n = x.size // BLOCK
        self._pending = x[n * BLOCK :]
        events = []
        dt = BLOCK / SAMPLE_RATE
        for b in x[: n * BLOCK].reshape(n, BLOCK) if n else ():
            voiced = float(np.sqrt(np.mean(b * b))) > self.threshold
            if voiced:
                if self._voiced_s == 0.0:
                    self._run_start = self._t
                self._voiced_s += dt
                self._quiet_s = 0.0
                self._last_voiced_end = self._t + dt
                if not self.speaking and self._voiced_s >= self.start_s - 1e-9:
                    self.speaking = True
                    events.append(("start", self._run_start))
            else:
                self._quiet_s += dt
                if self._quiet_s >= 0.1:  # a short dip does not restart the voiced run
                    self._voiced_s = 0.0
                if self.speaking and self._quiet_s >= self.stop_s - 1e-9:
                    self.speaking = False
                    events.append(("stop", self._last_voiced_end))
            self._t += dt
        return events


@dataclass
class Turn:
    """One user turn and the character's answer, timed (ms) from the user's end of speech."""

    index: int
    user_s: float  # how long the user spoke
    transcript: str | None = None
    reply: str | None = None
    stt_ms: float | None = None
    llm_ms: float | None = None
    tts_ms: float | None = None
    first_audio_ms: float | None = None  # end of speech -> the agent's first audio of the answer
    error: str | None = None
    interrupted: bool = False
    t_end: float = field(default=0.0, repr=False)  # host time of the user's end of speech
    #: wall-clock times (Unix seconds) of the user's end of speech and of the answer's first audio: a client
    #: on the same machine (a browser's ``performance.timeOrigin + now()``) times its own hops against them
    user_end_at: float | None = None
    first_audio_at: float | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("t_end")
        return {
            k: (round(v, 3) if k.endswith("_at") and v else round(v, 1) if isinstance(v, float) else v)
            for k, v in d.items()
        }


class TurnTakingAgent(Agent):
    """An agent that listens: voice activity on the microphone, barge-in while the character speaks.

    Subclasses answer a finished turn in ``answer(turn, audio)`` (a coroutine run by ``run()``, the
    session's agent task). ``barge_in`` off: the user's voice never interrupts."""

    barge_in = True
    max_turn_s = 30.0
    keep_turns = 100  # turns kept (and reported) per session

    def __init__(self, vad: VoiceActivity | None = None) -> None:
        super().__init__()
        self.vad = vad or VoiceActivity()
        self.turns: list[Turn] = []
        self.turn_count = 0
        self.barge_ins = 0
        self.errors: list[str] = []
        self.last_error: str | None = None
        self._turn_audio: list[np.ndarray] = []
        self._turn_start = 0.0  # stream time of the current turn's first voiced block
        self._events: asyncio.Queue | None = None
        self._answering: asyncio.Task | None = None
        self._t_stream0: float | None = None  # host time of mic stream time 0
        self._pushed = 0

    # (called on the event loop by the session's microphone task)
    def push_mic(self, samples: np.ndarray) -> None:
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        # Host time of mic stream time 0: arrival minus the audio pushed so far. Delivery only ever
        # delays a frame, so the smallest estimate is the truest (stream times -> host times below).
        self._pushed += samples.size
        t0 = time.monotonic() - self._pushed / SAMPLE_RATE
        self._t_stream0 = t0 if self._t_stream0 is None else min(self._t_stream0, t0)
        if self.vad.speaking or self._turn_audio:
            self._turn_audio.append(samples)
        for kind, t in self.vad.push(samples):
            host_t = self._t_stream0 + t
            if kind == "start":
                self._turn_audio = [samples]
                self._turn_start = t
                if self.barge_in and self.speaking():
                    self.barge_ins += 1
                    self.interrupt()
            elif kind == "stop":
                audio = np.concatenate(self._turn_audio) if self._turn_audio else np.zeros(0, np.float32)
                self._turn_audio = []
                if self._events is not None:
                    spoke = t - self._turn_start  # the voiced span (the audio also has the quiet after it)
                    self._events.put_nowait((host_t, spoke, audio[-int(self.max_turn_s * SAMPLE_RATE) :]))

    def speaking(self) -> bool:
        """Whether the character is (about to be) speaking: speech queued or an answer being made."""
        return self.queued_samples > 0 or (self._answering is not None and not self._answering.done())

    def interrupt(self) -> None:
        if self._answering is not None and not self._answering.done():
            self._answering.cancel()
            if self.turns:
                self.turns[-1].interrupted = True
        super().interrupt()

    async def run(self) -> None:
        """The agent's task (the session runs it): answer each finished turn, one at a time."""
        self._events = asyncio.Queue()
        while True:
            t_end, spoke, audio = await self._events.get()
            self.turn_count += 1
            turn = Turn(self.turn_count - 1, round(spoke, 3), t_end=t_end)
            turn.user_end_at = time.time() - (time.monotonic() - t_end)
            self.turns.append(turn)
            del self.turns[: -self.keep_turns]  # a long session keeps its last turns, not all of them
            self._answering = asyncio.create_task(self._answer(turn, audio))
            try:
                await asyncio.wait({self._answering})
            except asyncio.CancelledError:
                self._answering.cancel()
                raise

    async def _answer(self, turn: Turn, audio: np.ndarray) -> None:
        try:
            await self.answer(turn, audio)
        except asyncio.CancelledError:
            turn.interrupted = True
        except (InputError, RuntimeError) as e:  # an endpoint's error, TTS missing ...
            self.fail(turn, str(e))

    def fail(self, turn: Turn | None, message: str) -> None:
        message = " ".join(message.split())
        if turn is not None:
            turn.error = message
        self.last_error = message
        self.errors.append(message)
        del self.errors[:-20]
        log.warning("agent %s: %s", self.name, message)

    def say_now(self, turn: Turn, audio: np.ndarray) -> None:
        """Queue the answer's audio; its first sample is the turn's first agent audio."""
        now = time.monotonic()
        turn.first_audio_ms = (now - turn.t_end) * 1e3
        turn.first_audio_at = time.time()
        self.last_error = None
        self.speak(audio, t_agent=now)

    async def answer(self, turn: Turn, audio: np.ndarray) -> None:
        raise NotImplementedError

    def status_fields(self) -> dict:
        return {
            "agent_error": self.last_error,
            "turns": self.turn_count,
            "barge_ins": self.barge_ins,
            "user_speaking": self.vad.speaking,
        }

    def report_fields(self) -> dict:
        return {"turns": [t.as_dict() for t in self.turns], "agent_errors": list(self.errors)}


class SayAgent(TurnTakingAgent):
    """Typed text -> speech through espeak-ng (a subprocess), resampled to 48 kHz. It listens too: the
    user's voice on the microphone interrupts what it is saying (barge-in); turns are counted, not
    answered."""

    name = "say"
    max_text = 1000

    def __init__(self, voice: str = "en", speed: int = 160) -> None:
        super().__init__()
        self.voice, self.speed = voice, speed

    async def answer(self, turn: Turn, audio: np.ndarray) -> None:
        """A user turn is only counted (``say`` speaks what it is told, not answers)."""

    def say(self, text: str) -> float:
        """Synthesize ``text`` and queue it; returns the speech length in seconds."""
        audio = synthesize(text, self.voice, self.speed)
        self.speak(audio, t_agent=time.monotonic())  # the agent's first audio exists from now
        return audio.size / SAMPLE_RATE


# ---- espeak-ng -----------------------------------------------------------------------------------


def espeak_binary() -> str | None:
    """Path of espeak-ng (or espeak), None when not installed."""
    return shutil.which("espeak-ng") or shutil.which("espeak")


class TTSUnavailable(RuntimeError):
    pass


#: How much less CPU priority (nice) the text-to-speech process gets than the server: a sentence is a burst of
#: CPU that on a 2-core machine competed with the worker's chunks at the same priority. Say-only bench soaks,
#: alternating, 2 pairs of 2 minutes (docs/perf/soak/NOTES.md): at nice 0, 4 of 68 sessions below 23.5 fresh
#: fps and 14 late chunks; at nice 10, 0 of 67 and 7 (one pair clear, the other within the noise).
TTS_NICE = 10


def _background_priority() -> None:  # (in the child, before exec)
    import os

    try:
        os.nice(TTS_NICE)
    except OSError:
        pass


def synthesize(
    text: str, voice: str = "en", speed: int = 160, timeout: float = 20.0, max_seconds: float = 60.0
) -> np.ndarray:
    """``text`` -> float32 mono 48 kHz through ``espeak-ng --stdout --stdin`` (WAV) and PyAV's resampler;
    at most its first ``max_seconds`` (a text of the allowed length can take longer to say: 1,000 digits).

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
            preexec_fn=_background_priority,
        )
    except subprocess.TimeoutExpired:
        raise TTSUnavailable(f"espeak-ng did not finish within {timeout:.0f} s") from None
    if out.returncode != 0 or not out.stdout:
        msg = out.stderr.decode(errors="replace").strip() or f"exit status {out.returncode}"
        raise TTSUnavailable(f"espeak-ng failed: {msg}")
    return decode_audio_bytes(out.stdout, max_seconds, truncate=True)


def decode_audio_bytes(data: bytes, max_seconds: float = 60.0, truncate: bool = False) -> np.ndarray:
    """Any audio file FFmpeg decodes (bytes) -> float32 mono 48 kHz in [-1, 1]. ``InputError`` when it is not
    audio, or lasts more than ``max_seconds`` (``truncate``: its first ``max_seconds`` then);
    ``NonFiniteAudio`` (an ``InputError``) when any sample is NaN or infinite (a float WAV can carry them)."""
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
                    if truncate:
                        break
                    raise InputError(f"audio is too long (over {max_seconds:.0f} s)")
            for o in res.resample(None):
                pieces.append(o.to_ndarray().reshape(-1))
    except InputError:
        raise
    except Exception as e:
        detail = " ".join(str(e).split())[:200]  # FFmpeg's own words, without Python's exception names
        raise InputError(f"could not decode audio{': ' + detail if detail else ''}") from None
    samples = np.concatenate(pieces)[:limit] if pieces else np.zeros(0, np.float32)
    if samples.size == 0:
        raise InputError("audio contains no samples")
    return require_finite(samples)  # NonFiniteAudio for a NaN or an infinity (np.clip would keep a NaN)


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
