// The cadence page: one RTCPeerConnection per session, no build step, no external resources.
// Hooks for automated tests: window.cadence = {start, stop, say, state()}; data-* attributes on <body>.
// Auth: POST /sessions answers with the session's token; every request on the session sends it
// (Authorization: Bearer). When /config says the server has an operator key, the page shows a key
// field, asks for the key once and keeps it for this tab (sessionStorage) to create sessions with.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  let pc = null, sessionId = null, sessionToken = null, poll = null, micStream = null, keyRequired = false;
  const KEY_STORE = "cadence.apiKey";
  const bearer = (secret) => (secret ? { authorization: `Bearer ${secret}` } : {});
  const sessionHeaders = () => bearer(sessionToken);

  function setError(msg) { $("error").textContent = msg || ""; }
  function setState(s) { $("m-state").textContent = s; document.body.dataset.state = s; }
  const ms = (x) => (x === null || x === undefined) ? "-" : `${Math.round(x)} ms`;

  $("image").addEventListener("change", () => {
    const f = $("image").files[0];
    $("preview").src = f ? URL.createObjectURL(f) : "";
  });

  async function errorText(r) {
    try { const j = await r.json(); return j.error || JSON.stringify(j); } catch (e) { return `HTTP ${r.status}`; }
  }

  function waitGathering(pc) {
    if (pc.iceGatheringState === "complete") return Promise.resolve();
    return new Promise((resolve) => {
      const check = () => { if (pc.iceGatheringState === "complete") { pc.removeEventListener("icegatheringstatechange", check); resolve(); } };
      pc.addEventListener("icegatheringstatechange", check);
      setTimeout(resolve, 3000); // loopback gathers at once; never hang on it
    });
  }

  async function start() {
    setError("");
    if (pc) await stop();
    $("start").disabled = true;
    setState("starting");
    try {
      pc = new RTCPeerConnection({ iceServers: [] });
      const video = pc.addTransceiver("video", { direction: "recvonly" });
      const codec = $("codec").value; // "" = the browser's order; else offer only that codec (+ its rtx)
      if (codec) {
        const caps = (RTCRtpReceiver.getCapabilities("video") || { codecs: [] }).codecs;
        const want = caps.filter((c) => c.mimeType.toLowerCase() === `video/${codec.toLowerCase()}`);
        if (!want.length) throw new Error(`this browser cannot receive ${codec} video`);
        video.setCodecPreferences(want.concat(caps.filter((c) => c.mimeType.toLowerCase() === "video/rtx")));
      }
      let micTrack = null;
      if ($("use-mic").checked && navigator.mediaDevices && navigator.mediaDevices.getUserMedia) {
        try {
          micStream = await navigator.mediaDevices.getUserMedia({ audio: { echoCancellation: true, noiseSuppression: true } });
          micTrack = micStream.getAudioTracks()[0];
        } catch (e) { setError(`microphone unavailable (${e.name}); continuing without it`); }
      }
      if (micTrack) pc.addTransceiver(micTrack, { direction: "sendrecv", streams: [micStream] });
      else pc.addTransceiver("audio", { direction: "sendrecv" });
      const remote = new MediaStream();
      pc.addEventListener("track", (ev) => {
        remote.addTrack(ev.track);
        $("video").srcObject = remote; // one stream: the browser keeps audio and video in sync
      });
      pc.addEventListener("connectionstatechange", () => {
        document.body.dataset.connection = pc ? pc.connectionState : "closed";
      });
      await pc.setLocalDescription(await pc.createOffer());
      await waitGathering(pc);
      const form = new FormData();
      form.append("sdp", pc.localDescription.sdp);
      form.append("type", "offer");
      form.append("prompt", $("prompt").value);
      form.append("agent", $("agent").value);
      if ($("image").files[0]) form.append("image", $("image").files[0]);
      let key = null;
      if (keyRequired) {
        key = $("api-key").value.trim();
        if (!key) { $("api-key").focus(); throw new Error("this server needs its API key: enter it above"); }
        sessionStorage.setItem(KEY_STORE, key);
      }
      const r = await fetch("/sessions", { method: "POST", body: form, headers: bearer(key) });
      if (r.status === 401) { // no key, or a wrong one: ask (again)
        keyRequired = true; $("key-row").hidden = false;
        sessionStorage.removeItem(KEY_STORE); $("api-key").value = ""; $("api-key").focus();
      }
      if (!r.ok) throw new Error(await errorText(r));
      const ans = await r.json();
      sessionId = ans.session_id;
      sessionToken = ans.token;
      document.body.dataset.session = sessionId;
      $("m-preset").textContent = `${ans.preset} ${ans.width}x${ans.height} @ ${ans.fps} fps`;
      await pc.setRemoteDescription({ type: ans.type, sdp: ans.sdp });
      $("stop").disabled = false; $("say").disabled = false; $("interrupt").disabled = false;
      poll = setInterval(refresh, 500);
    } catch (e) {
      setError(String(e.message || e));
      await stop();
    } finally {
      $("start").disabled = false;
    }
  }

  async function refresh() {
    if (!sessionId) return;
    try {
      const r = await fetch(`/sessions/${sessionId}`, { headers: sessionHeaders() });
      if (!r.ok) { setError(await errorText(r)); return; }
      const s = await r.json();
      setState(s.state + (s.close_reason ? ` (${s.close_reason})` : ""));
      // a worker slower than real time: fewer fresh frames, the audio whole (the server says so)
      $("m-fps").textContent = `${s.fps.toFixed(1)} / ${s.target_fps}` +
        (s.degraded ? " (reduced: the server cannot keep up; audio intact)" : "");
      document.body.dataset.fps = s.fps;
      document.body.dataset.degraded = s.degraded ? "1" : "0";
      $("m-ttff").textContent = ms(s.ttff_ms);
      $("m-latency").textContent = ms(s.chunk_latency_ms_p50);
      // two measures, two names: speech given to the character, and the microphone that 'mirror' mouths
      $("m-agent").textContent = ms(s.agent_audio_to_frame_ms_last);
      $("m-mic").textContent = ms(s.mic_to_frame_ms_last);
      // the agent's endpoint failing (talk): one clear line; the stream keeps running
      if (s.agent_error) setError(`agent: ${s.agent_error}`);
      $("m-av").textContent = s.av_offset_ms === null ? "-" : `${s.av_offset_ms.toFixed(1)} ms`;
      $("m-under").textContent = `${s.underruns.video} / ${s.underruns.audio}`;
      $("m-codecs").textContent = s.video_codec ? `${s.video_codec} / ${s.audio_codec}` : "-";
      document.body.dataset.videoCodec = s.video_codec || "";
      if (s.state === "closed") { clearInterval(poll); poll = null; }
    } catch (e) { setError(String(e)); }
  }

  async function stop() {
    if (poll) { clearInterval(poll); poll = null; }
    const sid = sessionId, headers = sessionHeaders();
    sessionId = null;
    sessionToken = null;
    if (sid) {
      try { await fetch(`/sessions/${sid}`, { method: "DELETE", headers }); } catch (e) { /* closing anyway */ }
    }
    if (pc) { pc.close(); pc = null; }
    if (micStream) { micStream.getTracks().forEach((t) => t.stop()); micStream = null; }
    $("stop").disabled = true; $("say").disabled = true; $("interrupt").disabled = true;
    setState(sid ? "closed" : "idle");
  }

  async function say(text) {
    if (!sessionId) return;
    text = text === undefined ? $("say-text").value : text;
    const r = await fetch(`/sessions/${sessionId}/say`, {
      method: "POST", headers: { "content-type": "application/json", ...sessionHeaders() }, body: JSON.stringify({ text }),
    });
    if (!r.ok) setError(await errorText(r)); else setError("");
    return r.ok;
  }

  async function interrupt() {
    if (sessionId) await fetch(`/sessions/${sessionId}/interrupt`, { method: "POST", headers: sessionHeaders() });
  }

  $("start").addEventListener("click", start);
  $("stop").addEventListener("click", stop);
  $("say").addEventListener("click", () => say());
  $("interrupt").addEventListener("click", interrupt);
  window.addEventListener("beforeunload", () => {
    if (sessionId) fetch(`/sessions/${sessionId}`, { method: "DELETE", keepalive: true, headers: sessionHeaders() });
  });
  fetch("/config").then((r) => r.json()).then((c) => {
    $("m-preset").textContent = `${c.preset} ${c.width}x${c.height} @ ${c.fps} fps`;
    if (!c.say_available) $("agent").querySelector("option[value=say]").textContent += " (espeak-ng not installed)";
    if (!c.talk_available) $("agent").querySelector("option[value=talk]").textContent += " (no --agent-url on the server)";
    keyRequired = !!c.api_key_required;
    document.body.dataset.keyRequired = keyRequired ? "1" : "0";
    $("key-row").hidden = !keyRequired;
    if (keyRequired) $("api-key").value = sessionStorage.getItem(KEY_STORE) || "";
  }).catch(() => {});
  window.cadence = { start, stop, say, interrupt, state: () => ({ sessionId, token: sessionToken, pc }) };
  setState("idle");
})();
