"""Pacing and the media clock, as pure functions and plain data (no asyncio, no aiortc).

One media clock drives both tracks. It starts once, at ``t0`` (the first time either WebRTC track
asks for media), and every presentation time is derived from it:

* video frame ``k`` is due at ``t0 + k / fps`` and stamped ``pts = k * 90000 / fps`` in 1/90000
  (3,750 at 24 fps; aiortc's stock video clock would pace and stamp at 30 fps);
* audio frame ``n`` (20 ms = 960 samples) is due at ``t0 + n * 960 / 48000`` and stamped
  ``pts = n * 960`` in 1/48000 (Opus counts samples anyway: we never leave gaps, we send silence);
* chunk ``c`` (F frames and F x 48000 / fps samples: 4 frames / 8,000 samples / 166.7 ms at the
  tiny presets, W14 and W57; 12 / 24,000 / 500 ms at W1.3) is due at ``t0 + c * F / fps``; the
  scheduler plans it (hands its audio window to the worker) ``lead`` seconds earlier.

Because both tracks read the same ``t0`` and the same chunk store, a frame and the audio of the
same media instant are always taken from the same chunk: the streams cannot drift apart, whatever
the network or the model does. A chunk's audio is in the store from the moment it is planned (the
agent's audio window does not need the model), its frames from the moment the worker has them back.
Underrun policy (``AVBuffer``): when a chunk's frames are not there by the time they are due, video
holds the last frame (counted), and so it does for a generated frame that is blank (one colour: what a
non-finite model output decodes to; fresh is counted by content); a chunk whose frames arrive late is used for what is still in the
future (the clock never stops). Audio goes silent only where no chunk was planned at all (a stalled
event loop). When the worker is slower than real time, ``ChunkPlanner`` asks it only for the chunks
it can return in time and plays the others' audio with the last frame held: fewer fresh frames per
second, never a frozen face behind a growing queue, the audio whole.

A clip stream's speech cut-in (``cut_in_point``, ``ChunkPlanner.cut_in``, ``AVBuffer.cut``) starts a chunk at a
frame k inside the chunks already planned: from k on its frames and samples replace theirs (only silence is
ever replaced), and every later chunk starts on the grid moved by k's offset (``ChunkPlanner.shift``; the
buffer keeps each cut as a segment: (first chunk, its first frame)). The tracks still read one media index
for both halves, so a frame and its audio still come from the same chunk; while the cut-in's frames are not
back, the frames queued before it stand in (counted). Without a cut (every chunk-grid family) the arithmetic
is the plain grid's above, to the bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

VIDEO_CLOCK_RATE = 90_000  # RTP video clock; pts of video frames are in 1/90000 s
AUDIO_FRAME_SECONDS = 0.020  # 20 ms audio frames, as WebRTC (Opus) sends them


@dataclass(frozen=True)
class MediaTiming:
    """The media clock's arithmetic for one stream geometry (``from_config``: tiny, W14, W57: 24 fps and
    4 frames per chunk; W1.3: 24 fps and 12 frames per chunk)."""

    fps: int = 24
    frames_per_chunk: int = 4
    sample_rate: int = 48_000

    def __post_init__(self) -> None:
        if VIDEO_CLOCK_RATE % self.fps:
            raise ValueError(f"fps {self.fps} does not divide the 90 kHz video clock")
        if (self.frames_per_chunk * self.sample_rate) % self.fps:
            raise ValueError(
                f"{self.frames_per_chunk} frames at {self.fps} fps is not a whole number of samples "
                f"at {self.sample_rate} Hz"
            )

    @classmethod
    def from_config(cls, cfg) -> MediaTiming:
        from cadence.config import AUDIO_SAMPLE_RATE

        return cls(
            fps=cfg.stream.fps, frames_per_chunk=cfg.video_frames_per_chunk, sample_rate=AUDIO_SAMPLE_RATE
        )

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def samples_per_chunk(self) -> int:
        return self.frames_per_chunk * self.sample_rate // self.fps

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per video frame (2,000 at 48 kHz / 24 fps)."""
        return self.sample_rate // self.fps

    @property
    def audio_frame_samples(self) -> int:
        return int(round(AUDIO_FRAME_SECONDS * self.sample_rate))

    @property
    def video_pts_step(self) -> int:
        return VIDEO_CLOCK_RATE // self.fps

    @property
    def chunk_seconds(self) -> float:
        return self.frames_per_chunk / self.fps

    # ---- due times (seconds on the host clock) and stamps ----------------------------------------
    def video_due(self, t0: float, k: int) -> float:
        return t0 + k / self.fps

    def audio_due(self, t0: float, n: int) -> float:
        return t0 + n * self.audio_frame_samples / self.sample_rate

    def chunk_due(self, t0: float, c: int) -> float:
        return t0 + c * self.chunk_seconds

    def plan_time(self, t0: float, c: int, lead: float) -> float:
        """When the scheduler should hand chunk ``c`` to the worker: ``lead`` before it is due."""
        return self.chunk_due(t0, c) - lead

    def video_pts(self, k: int) -> int:
        return k * self.video_pts_step

    def audio_pts(self, n: int) -> int:
        return n * self.audio_frame_samples

    def frame_chunk(self, k: int) -> tuple[int, int]:
        """(chunk, frame within the chunk) of video frame ``k``."""
        return divmod(k, self.frames_per_chunk)

    def frame_of_sample(self, sample: int) -> int:
        """The video frame on screen while media sample ``sample`` plays."""
        return sample // self.samples_per_frame


def first_frame_after(t: float, t0: float, fps: int) -> int:
    """The first video frame due at or after host time ``t`` on the media clock started at ``t0``."""
    return max(0, math.ceil((t - t0) * fps - 1e-9))


def next_video_frame(
    k: int, now: float, t0: float, timing: MediaTiming, max_lag_frames: int = 2
) -> tuple[int, float, int]:
    """The video pacer: which frame to send next and how long to wait for it.

    ``k`` is the next frame in order. If its due time is ahead, wait for it. If the sender fell
    behind by more than ``max_lag_frames`` frames (a stalled event loop or encoder), jump to the
    frame due now instead of bursting old frames: video then stays on the media clock, and the
    skipped frames are returned as a count. Returns ``(frame, wait_seconds, skipped)``.
    """
    due = timing.video_due(t0, k)
    if now <= due:
        return k, due - now, 0
    current = int(math.floor((now - t0) * timing.fps + 1e-9))
    if current - k > max_lag_frames:
        return current, 0.0, current - k
    return k, 0.0, 0


def next_audio_frame(
    n: int, now: float, t0: float, timing: MediaTiming, max_lag_frames: int = 5
) -> tuple[int, float, int]:
    """The audio pacer, as ``next_video_frame`` for 20 ms frames (more slack: Opus frames are cheap)."""
    due = timing.audio_due(t0, n)
    if now <= due:
        return n, due - now, 0
    per = timing.audio_frame_samples / timing.sample_rate
    current = int(math.floor((now - t0) / per + 1e-9))
    if current - n > max_lag_frames:
        return current, 0.0, current - n
    return n, 0.0, 0


@dataclass(frozen=True)
class CutIn:
    """What a clip stream's session can do (``WorkerInfo.cut_in``): start a clip up to ``max_rewind`` frames
    before the end of the last clip it made, from the ``motion_frames`` frames before that point."""

    max_rewind: int
    motion_frames: int


def cut_in_point(
    k: int, end: int, made_from: int, made_to: int, cut: CutIn, not_before: int = 0
) -> int | None:
    """Where a cut-in clip starts: frame ``k`` (the first one still replaceable) when it is before ``end`` (the
    first frame not yet planned), the worker made every frame from ``k - motion_frames`` to ``end`` in one run
    (``made_from``/``made_to``: its clips' frames, without a gap), ``end - k`` is within ``max_rewind``, and ``k``
    is at or after ``not_before`` (the last cut-in's clip is kept whole). None: no cut-in (the next chunk on the
    grid is as early)."""
    if k >= end or made_to != end or k - cut.motion_frames < made_from or k < not_before:
        return None
    if end - k > cut.max_rewind:
        return None
    return k


@dataclass
class Plan:
    """The scheduler's decision for one chunk: generate it (send its audio window to the worker), or play
    its audio with the last frame held (``generate`` False: the worker cannot have it back in time)."""

    chunk: int
    generate: bool
    start: float  # when the worker is expected to begin it (monotonic s)
    expected_done: float  # when its frames are expected back
    prestart: bool = False  # planned before the media clock started (with the next one, at once)
    start_frame: int | None = None  # its first video frame (None: chunk x frames per chunk)
    cut_in: bool = False  # it starts inside chunks already planned (``ChunkPlanner.cut_in``)


@dataclass
class ChunkPlanner:
    """Which chunk to plan next, when, and whether the worker can make it in time. Pure (a fake clock
    drives it in the tests).

    Before the media clock starts (``t0`` None) the first ``prestart`` chunks are planned at once (they are
    ready when the tracks start). After it starts, chunk ``c`` is planned ``lead`` before it is due
    (``timing.plan_time``), whatever the worker is doing: its audio always plays (the session puts it in the
    buffer at plan time), so a slow worker never costs audio. Whether the worker also generates its video is
    predicted from the worker's measured speed: ``latency`` (s, plan -> frames back for a chunk started on
    an idle worker) and ``interval`` (s, the sustained time per chunk with decode overlapped). The worker
    can begin chunk c at ``max(now, busy_until)`` and is done ``latency`` later; if that is after c is due
    (or ``max_in_flight`` chunks are out), c is audio-only and its frames are never asked for: the viewer
    sees fresh frames at the rate the worker sustains (the last frame held in between), never a frozen
    face behind an ever-growing queue, and the audio stays whole.

    ``observe`` feeds the measured figures of every chunk that comes back (recent medians decide; the lead
    covers the recent p90 latency: ``lead >= p90 x 1.1 + 20 ms``, plus ``interval - chunk period`` when
    the worker is slower than real time, so that it can work back to back), so a worker that is slower than
    its warm-up said still gets its chunks back before they are due. If the event loop stalls past a chunk's due
    time, the chunks already in the past are skipped (``skipped``): nothing of them could still play."""

    timing: MediaTiming
    lead: float
    latency: float
    interval: float
    max_in_flight: int = 2
    prestart: int = 2
    history: int = 24
    next_chunk: int = 0
    shift: int = 0  # frames: chunk c (from the last cut-in on) starts at frame c x F + shift (``cut_in``)
    busy_until: float = 0.0
    in_flight: int = 0
    skipped: int = 0
    audio_only: int = 0
    cut_ins: int = 0
    base_lead: float = field(init=False)
    latency_tail: float = field(init=False)  # a high quantile (p90) of recent latencies: what the lead covers
    _lat: list[float] = field(default_factory=list)
    _int: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.base_lead = self.lead
        self.latency_tail = self.latency
        self.lead = max(self.lead, self._needed_lead())

    def _needed_lead(self) -> float:
        """The least lead that gets chunks back in time: one chunk's latency (+10% + 20 ms), plus, when the worker
        sustains less than real time, the time it may have to wait for the worker (interval - chunk period), so
        that it can work back to back on every chunk it can make (fresh frames at its full rate)."""
        return self.latency_tail * 1.1 + 0.02 + max(0.0, self.interval - self.timing.chunk_seconds)

    def start_frame(self, c: int) -> int:
        """The first video frame of chunk ``c`` (planned from the last cut-in on)."""
        return c * self.timing.frames_per_chunk + self.shift

    def chunk_due(self, t0: float, c: int) -> float:
        """When chunk ``c``'s first frame is due: ``timing.chunk_due`` moved by the cut-ins' shift."""
        return self.timing.chunk_due(t0, c) + self.shift / self.timing.fps

    def poll(self, now: float, t0: float | None) -> tuple[Plan | None, float | None]:
        """``(plan, wait)``: a chunk to plan now (wait 0), or wait this long (None: until an event, i.e.
        the clock starting)."""
        c = self.next_chunk
        if t0 is None:
            if c < self.prestart:
                return self._plan(c, now, None), 0.0
            return None, None
        if now > self.chunk_due(t0, c + 1):  # fell behind (a stalled loop): what is past is gone
            skip_to = int((now - t0 - self.shift / self.timing.fps) / self.timing.chunk_seconds) + 1
            self.skipped += skip_to - c
            c = self.next_chunk = skip_to
        at = self.chunk_due(t0, c) - self.lead
        if now < at:
            return None, at - now
        return self._plan(c, now, t0), 0.0

    def _plan(self, c: int, now: float, t0: float | None) -> Plan:
        start = max(now, self.busy_until)
        done = start + self.latency
        ok = self.in_flight < self.max_in_flight and (t0 is None or done <= self.chunk_due(t0, c))
        self.next_chunk = c + 1
        if ok:
            self.busy_until = start + self.interval
            self.in_flight += 1
        else:
            self.audio_only += 1
        return Plan(c, ok, start, done, prestart=t0 is None, start_frame=self.start_frame(c))

    def cut_in_frame(self, now: float, t0: float) -> int:
        """The first frame a clip planned now can still replace: when the worker is free (``busy_until``), plus
        one clip's latency as the lead covers it (its recent p90 x 1.1 + 20 ms), on the media clock."""
        ready = max(now, self.busy_until) + self.latency_tail * 1.1 + 0.02
        return first_frame_after(ready, t0, self.timing.fps)

    def cut_in(self, now: float, t0: float, k: int) -> Plan:
        """Plan the next chunk to start at frame ``k`` (before the planned grid's end: a cut-in) and every
        chunk after it on the grid moved by ``k``'s offset (``shift``). Always generated: the caller checked
        that a chunk may be sent (``in_flight < max_in_flight``)."""
        c = self.next_chunk
        self.shift = k - c * self.timing.frames_per_chunk
        start = max(now, self.busy_until)
        self.next_chunk = c + 1
        self.busy_until = start + self.interval
        self.in_flight += 1
        self.cut_ins += 1
        return Plan(c, True, start, start + self.latency, start_frame=k, cut_in=True)

    def observe(self, now: float, plan: Plan, interval: float | None = None) -> None:
        """A generated chunk came back at ``now``: ``plan`` was its plan; ``interval`` the worker's own
        figure for its sustained time per chunk (the slower of its stages), if it reported one."""
        self.in_flight = max(0, self.in_flight - 1)
        if self.in_flight == 0:
            self.busy_until = min(self.busy_until, now)  # idle now, whatever was predicted
        if plan.prestart:
            # the chunks planned before the clock started go to the worker together, the first decoded alone
            # (time to first frame) while the next waits for it, and while the connection is being set up:
            # neither is the latency of a chunk planned on the clock (a second chunk's "latency" of two chunks'
            # work once made the planner reduce chunks 3-4 of every session to audio: docs/perf/soak/NOTES.md)
            return
        self._lat = (self._lat + [max(0.0, now - plan.start)])[-self.history :]
        if interval is not None:
            self._int = (self._int + [interval])[-self.history :]
        if len(self._lat) >= 3:
            self.latency = _median(self._lat)
            self.latency_tail = _quantile(self._lat, 0.9)
        if len(self._int) >= 3:
            self.interval = _median(self._int)
        self.lead = max(self.base_lead, self._needed_lead())

    def lost(self) -> None:
        """A generated chunk will not come back (its request failed): free its place."""
        self.in_flight = max(0, self.in_flight - 1)


#: The share of every vCPU's time a hypervisor may take from a CPU worker for a while (CPU steal) that the lead
#: of a CPU group absorbs. The recorded soaks on a shared 2-core VM met stretches of 23-42% steal, and every
#: session below target ran in one (docs/perf/soak/NOTES.md, finding 7).
STEAL_HEADROOM = 0.30


def steal_slowdown(threads: int, steal: float = STEAL_HEADROOM) -> float:
    """How much longer a CPU worker's chunk takes while ``steal`` of every vCPU's time is taken: its ``threads``
    intra-op threads meet at every operator, so it advances only while all of their vCPUs run, a share
    (1 - steal)^threads of the time: 1.43x for one thread at 30%, 2.04x for two. (The late chunks of the
    recorded soaks took 2.4-3x their quiet time in 23-42% steal, two threads: the same order.)"""
    return 1.0 / (1.0 - steal) ** max(1, int(threads))


@dataclass
class LatencyProfile:
    """A worker group's chunk latencies (plan -> frames back, s) over its recent sessions, on the clock
    (chunks planned before a session's clock started are left out, as in ``ChunkPlanner.observe``).

    A session's planner sees only its own chunks, a few dozen in a short session, so its lead follows their
    p90; the misses that make a session lose frames are the rare slower chunks a session is too short to
    see. The group's history over many sessions has them: a new session starts with a lead that covers
    ``quantile`` of the last ``keep`` chunks, x ``scale`` + ``add`` (``lead``), once ``min_samples`` are in.
    Pure; the web side keeps one per group (``WorkerGroup.latency_profile``)."""

    keep: int = 1200  # ~3 min of streaming at 4 frames per chunk
    min_samples: int = 100
    quantile: float = 0.99
    scale: float = 1.25
    add: float = 0.02
    _xs: list[float] = field(default_factory=list)

    def add_latency(self, seconds: float) -> None:
        self._xs.append(float(seconds))
        if len(self._xs) > 2 * self.keep:
            del self._xs[: len(self._xs) - self.keep]

    def lead(self, slowdown: float = 1.0) -> float | None:
        """The lead (s) a new session should start with, or None while there are too few samples;
        ``slowdown``: how much longer chunks may take for a while than these did (``steal_slowdown``)."""
        xs = self._xs[-self.keep :]
        if len(xs) < self.min_samples:
            return None
        return _quantile(xs, self.quantile) * self.scale * slowdown + self.add


def _quantile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * (len(ys) - 1) + 0.5))]


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


SYNC_TONE_HZ = 1000.0  # the sync marker's audio: a 1 kHz tone burst ...
SYNC_TONE_SECONDS = 0.040  # ... 40 ms long, at amplitude 0.5
SYNC_TONE_AMPLITUDE = 0.5


def sync_marker_frames(frames: np.ndarray) -> np.ndarray:
    """The video half of the A/V sync marker: the chunk's first frame solid white (a copy)."""
    frames = np.array(frames, dtype=np.uint8, copy=True)
    frames[0] = 255
    return frames


def sync_marker_audio(
    audio: np.ndarray,
    timing: MediaTiming,
    tone_seconds: float = SYNC_TONE_SECONDS,
    tone_hz: float = SYNC_TONE_HZ,
    amplitude: float = SYNC_TONE_AMPLITUDE,
) -> np.ndarray:
    """The audio half: the chunk's first ``tone_seconds`` a ``tone_hz`` tone burst (a copy)."""
    audio = np.array(audio, dtype=np.float32, copy=True)
    n = min(audio.shape[0], round(tone_seconds * timing.sample_rate))
    t = np.arange(n, dtype=np.float64) / timing.sample_rate
    audio[:n] = (amplitude * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)
    return audio


def apply_sync_marker(
    frames: np.ndarray,
    audio: np.ndarray,
    timing: MediaTiming,
    tone_seconds: float = SYNC_TONE_SECONDS,
    tone_hz: float = SYNC_TONE_HZ,
    amplitude: float = SYNC_TONE_AMPLITUDE,
) -> tuple[np.ndarray, np.ndarray]:
    """An A/V sync marker on one chunk, at the media layer (after the model): its first video frame
    becomes solid white and its first ``tone_seconds`` of audio a ``tone_hz`` tone burst. Both start at
    the chunk's first media instant (frame 0 and sample 0 of the chunk), so a receiver that sees the
    flash and hears the tone onset at different times measures its own A/V offset. Returns copies."""
    return sync_marker_frames(frames), sync_marker_audio(audio, timing, tone_seconds, tone_hz, amplitude)


@dataclass
class AVBuffer:
    """Chunks keyed by index: each chunk's audio (put when it is planned, so it always plays) and its video
    frames (put when the worker has them back, if it generated them); video and audio frames read out by
    media index with the underrun policy (hold the last frame / silence), counted. Plain data: the tracks
    call it."""

    timing: MediaTiming
    height: int
    width: int
    keep_chunks: int = 12
    sync_marker_every: int = 0  # > 0: every K-th chunk (0, K, 2K, ...) carries the A/V sync marker
    audio: dict[int, np.ndarray] = field(default_factory=dict)
    video: dict[int, np.ndarray] = field(default_factory=dict)
    video_underruns: int = 0  # video frames held (their chunk's frames were not here)
    audio_underruns: int = (
        0  # 20 ms audio frames (partly) replaced by silence (their chunk was never planned)
    )
    video_fresh: int = 0  # video frames sent from a generated chunk, not blank (what the viewer gets)
    video_blank: int = 0  # generated frames that were blank (one colour: a NaN decodes to black), replaced
    late_chunks: int = 0  # generated chunks whose frames came back after all of them were due
    cut_in_fallback: int = (
        0  # frames after a cut-in played from the clip queued before it (the cut-in's late)
    )
    last_fallback: bool = (
        False  # the last video frame read was such a frame (not the cut-in's: no speech yet)
    )
    _last: np.ndarray | None = None
    _blank: dict[int, frozenset] = field(default_factory=dict)  # per chunk: its blank frames
    _min_needed: int = 0
    _video_chunk: int | None = None
    _audio_chunk: int | None = None
    #: the cut-ins, oldest first: (first chunk, its first frame); chunk c of a segment starts at
    #: first frame + (c - first chunk) x F. None before the first: chunk c starts at c x F (the grid)
    segments: list[tuple[int, int]] = field(default_factory=list)

    def cut(self, c: int, frame: int) -> None:
        """Chunk ``c`` and the chunks after it start at frame ``frame`` (a cut-in): from ``frame`` on they replace
        the chunks planned before ``c``; those keep the frames and samples before it, and stand in for the
        cut-in's video while its frames are not back (never a frozen face)."""
        if self.segments and (c <= self.segments[-1][0] or frame < self.segments[-1][1]):
            raise ValueError(
                f"cut-in at chunk {c} frame {frame} goes back before the last {self.segments[-1]}"
            )
        self.segments.append((c, frame))

    def chunk_start(self, c: int) -> int:
        """Chunk ``c``'s first video frame."""
        f = self.timing.frames_per_chunk
        for first, frame in reversed(self.segments):
            if c >= first:
                return frame + (c - first) * f
        return c * f

    def _covering(self, k: int) -> list[tuple[int, int]]:
        """The chunks that hold frame ``k``, newest first: (chunk, frame within it). One on the plain grid; a
        frame at or after a cut-in also lies in the chunk of each segment before it that reaches it."""
        f = self.timing.frames_per_chunk
        if not self.segments:
            return [divmod(k, f)]
        out = []
        bounds = [(0, 0)] + self.segments
        for s in range(len(bounds) - 1, -1, -1):
            first, frame = bounds[s]
            if k < frame:
                continue
            c, i = divmod(k - frame, f)
            c += first
            if s + 1 < len(bounds) and c >= bounds[s + 1][0]:  # that chunk belongs to the next segment
                continue
            out.append((c, i))
        return out

    def put_audio(self, c: int, audio: np.ndarray) -> None:
        """Chunk ``c``'s audio window (at plan time)."""
        if audio.shape[0] != self.timing.samples_per_chunk:
            raise ValueError(
                f"chunk {c}: expected {self.timing.samples_per_chunk} samples, got {audio.shape[0]}"
            )
        audio = audio.astype(np.float32, copy=False)
        if self.sync_marker_every > 0 and c % self.sync_marker_every == 0:
            audio = sync_marker_audio(audio, self.timing)
        self.audio[c] = audio
        self._gc()

    def put_video(self, c: int, frames: np.ndarray) -> None:
        """Chunk ``c``'s frames (when the worker has them back)."""
        f = self.timing.frames_per_chunk
        if frames.shape[0] != f:
            raise ValueError(f"chunk {c}: expected {f} frames, got {frames.shape[0]}")
        if self._video_chunk is not None and c < self._video_chunk:  # every frame of it is in the past
            self.late_chunks += 1
            return
        blank = frozenset(i for i in range(f) if is_blank(frames[i]))  # (the model's, before any marker)
        if self.sync_marker_every > 0 and c % self.sync_marker_every == 0:
            frames = sync_marker_frames(frames)
        self.video[c] = frames
        self._blank[c] = blank
        self._gc()

    def put_chunk(self, c: int, frames: np.ndarray, audio: np.ndarray) -> None:
        """Both halves of chunk ``c`` at once."""
        if frames.shape[0] != self.timing.frames_per_chunk or audio.shape[0] != self.timing.samples_per_chunk:
            raise ValueError(
                f"chunk {c}: expected {self.timing.frames_per_chunk} frames and "
                f"{self.timing.samples_per_chunk} samples, got {frames.shape[0]} and {audio.shape[0]}"
            )
        if c < self._min_needed:  # entirely in the past: nothing of it can still be played
            self.late_chunks += 1
            return
        self.put_audio(c, audio)
        self.put_video(c, frames)

    def silence_from(self, sample: int) -> int:
        """Silence every planned audio sample from stream sample ``sample`` on (an interrupted agent: the
        speech already planned into chunks not yet played stops at once). Returns the samples silenced."""
        spc, spf = self.timing.samples_per_chunk, self.timing.samples_per_frame
        n = 0
        for c, a in list(self.audio.items()):
            start = max(0, sample - self.chunk_start(c) * spf)
            if start < spc:
                a = a.copy()
                n += spc - start
                a[start:] = 0.0
                self.audio[c] = a
        return n

    def silent_from(self, frame: int, end: int) -> bool:
        """Whether every audio sample planned for frames [``frame``, ``end``) is silence (what a cut-in there may
        replace without dropping a sample the agent gave)."""
        spf = self.timing.samples_per_frame
        for k in range(frame, end):
            c, i = self._covering(k)[0]
            a = self.audio.get(c)
            if a is not None and np.any(a[i * spf : (i + 1) * spf]):
                return False
        return True

    def has_chunk(self, c: int) -> bool:
        return c in self.video

    @property
    def newest_video(self) -> int | None:
        return max(self.video) if self.video else None

    def blank(self) -> np.ndarray:
        return np.zeros((self.height, self.width, 3), np.uint8)

    def video_frame(self, k: int) -> tuple[np.ndarray, bool]:
        """Frame ``k`` (uint8 [H, W, 3]) and whether it is fresh: a generated picture the viewer gets. Not fresh
        (the last good frame held): its chunk is not here (``video_underruns``), or the frame is blank (every
        pixel one colour, what a non-finite model output decodes to: ``video_blank``). So the fresh count,
        and every figure made from it (the status's fps, the page, ``/metrics``, the report), counts
        neither a held frame nor a black one."""
        c, i = self._pick(k)
        self.last_fallback = bool(self.segments) and c < self._covering(k)[0][0]
        self.cut_in_fallback += self.last_fallback
        ch = self.video.get(c)
        self._video_chunk = c
        self._gc()
        held = self._last if self._last is not None else self.blank()
        if ch is None:
            self.video_underruns += 1
            return held, False
        f = ch[i]
        if i in self._blank.get(c, ()):
            self.video_blank += 1
            return held, False
        self._last = f
        self.video_fresh += 1
        return f, True

    def _pick(self, k: int) -> tuple[int, int]:
        """The chunk frame ``k`` is read from: the newest that holds it and has its frames here (a cut-in's
        while it is back, else what was queued before it), or the newest when none is here."""
        got = self._covering(k)
        for c, i in got:
            if c in self.video:
                return c, i
        return got[0]

    def audio_frame(self, n: int) -> tuple[np.ndarray, bool]:
        """Audio frame ``n`` (float32 [960]) and whether it is complete (False: silence filled in)."""
        t = self.timing
        size = t.audio_frame_samples
        start = n * size
        out = np.zeros(size, np.float32)
        complete = True
        pos = start
        first = None
        while pos < start + size:
            c, off, take = self._audio_at(pos, start + size - pos)
            first = c if first is None else first
            ch = self.audio.get(c)
            if ch is None:
                complete = False
            else:
                out[pos - start : pos - start + take] = ch[off : off + take]
            pos += take
        if not complete:
            self.audio_underruns += 1
        self._audio_chunk = first
        self._gc()
        return out, complete

    def _audio_at(self, pos: int, want: int) -> tuple[int, int, int]:
        """Stream sample ``pos``: (its chunk, its offset in that chunk's audio, how many samples from there on,
        at most ``want``, come from the same chunk: up to its end or the next cut-in's first sample)."""
        spf, spc = self.timing.samples_per_frame, self.timing.samples_per_chunk
        if not self.segments:
            c, off = divmod(pos, spc)
            return c, off, min(want, spc - off)
        c, _ = self._covering(pos // spf)[0]
        off = pos - self.chunk_start(c) * spf
        later = [f * spf for _, f in self.segments if f * spf > pos]
        end = min([self.chunk_start(c) * spf + spc] + later)
        return c, off, min(want, end - pos)

    def _gc(self) -> None:
        # a track that never started (a video-only client) does not hold chunks back
        marks = [m for m in (self._video_chunk, self._audio_chunk) if m is not None]
        self._min_needed = min(marks) if marks else 0
        for store in (self.audio, self.video):
            for old in [k for k in store if k < self._min_needed]:
                del store[old]
            if len(store) > self.keep_chunks:  # a runaway producer: keep the oldest needed ones
                for old in sorted(store)[self.keep_chunks :]:
                    del store[old]
        for old in [k for k in self._blank if k not in self.video]:
            del self._blank[old]
        while (
            len(self.segments) > 1 and self.segments[1][0] <= self._min_needed
        ):  # only the newest one is read
            del self.segments[0]


def _probe(frame: np.ndarray) -> np.ndarray:
    """A sparse grid of ``frame``'s pixels (about 32 x 32 of them)."""
    step = max(1, min(frame.shape[0], frame.shape[1]) // 32)
    return frame[::step, ::step]


def is_blank(frame: np.ndarray) -> bool:
    """Every pixel of ``frame`` the same colour value (a decoded NaN is black: a face never is one colour).
    A sparse grid first: a generated frame is told from a blank one at about 1/64 of a full pass."""
    first = frame.flat[0]
    return bool((_probe(frame) == first).all() and (frame == first).all())


def to_s16(samples: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16 for the Opus encoder."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype(np.int16)
