// The talk page: microphone -> /v1/realtime?duplex=1 (same origin) -> speakers, with the
// transcript, a level meter per side, connection state, latency and errors in plain words.
//
// One Conversation at a time. Its life: audio up (AudioContext + worklets + microphone),
// socket open, `session.update` opens the session (the server runs the persona prefill), then
// every 80 ms mic chunk goes out as `input_audio_buffer.append` and every model frame
// (`response.output_audio.delta`) goes to the player worklet's jitter buffer.
// Stop sends `session.close`, waits briefly for `session.closed`, and tears everything down.

const FRAME_MS = 80;
const WIRE_RATE = 24000;
const JITTER_TARGET_MS = 160; // playback starts (and restarts after an underrun) with this much queued
const JITTER_MAX_MS = 600; // beyond this the player drops its oldest audio
const HEARTBEAT_MS = 1000;
const CLOSE_WAIT_MS = 3000; // how long Stop waits for session.closed before closing the socket

const AUDIO_DELTAS = new Set(["response.output_audio.delta", "response.audio.delta"]);
const TEXT_DELTAS = new Set(["response.output_audio_transcript.delta", "response.audio_transcript.delta"]);

const $ = (id) => document.getElementById(id);

// ---- what the page shows ---------------------------------------------------------

const STATE_WORDS = {
  idle: "idle",
  starting: "starting audio …",
  connecting: "connecting …",
  opening: "opening session (loading the persona) …",
  live: "live: talk now",
  closing: "closing …",
  closed: "closed",
  error: "stopped by an error",
};

function setState(state, detail = "") {
  const el = $("state");
  el.dataset.state = state;
  el.textContent = STATE_WORDS[state] + (detail ? ` (${detail})` : "");
  const dot = $("state-dot");
  dot.className = "dot " + ({ live: "live", error: "error", starting: "busy", connecting: "busy", opening: "busy", closing: "busy" }[state] || "idle");
}

function showError(message) {
  const el = $("error");
  el.hidden = false;
  el.textContent = el.textContent ? `${el.textContent}\n${message}` : message;
}

function clearError() {
  const el = $("error");
  el.hidden = true;
  el.textContent = "";
}

function setMeter(which, rms, peak) {
  const db = rms > 0 ? 20 * Math.log10(rms) : -Infinity;
  const fraction = Math.max(0, Math.min(1, (db + 60) / 60)); // -60 dBFS .. 0 dBFS
  $(`${which}-meter`).style.width = `${(100 * fraction).toFixed(1)}%`;
  const label = $(`${which}-level`);
  label.dataset.rms = String(rms);
  label.dataset.peak = String(peak);
  label.textContent = Number.isFinite(db) ? `${db.toFixed(0)} dBFS` : "silent";
}

// Close codes in plain words (the server's reason, when it gave one, is added).
function describeClose(code, reason) {
  const words = {
    1000: "the session ended normally",
    1001: "the server is going away (restart or shutdown)",
    1006: "the connection was lost (no close message: network failure or the server stopped)",
    1008: "the server refused this client",
    1011: "the server hit an internal error",
    1013: "the server is busy: try again later",
  }[code] || `the connection closed with code ${code}`;
  return reason ? `${words}: ${reason}` : words;
}

// ---- wire helpers ------------------------------------------------------------------

function base64FromBytes(buffer) {
  const bytes = new Uint8Array(buffer);
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function bytesFromBase64(text) {
  const s = atob(text);
  const bytes = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
  return bytes.buffer;
}

// A server with an API key: the key (typed here, kept in this tab only) mints a short-lived client
// secret over fetch, which can send headers; the WebSocket, which cannot, carries that secret as the
// `openai-insecure-api-key.` subprotocol beside `realtime`, as OpenAI's browser clients do.
async function socketProtocols() {
  const key = $("api-key").value.trim();
  sessionStorage.setItem("personaplex-api-key", key);
  const reply = await fetch("/v1/realtime/client_secrets", {
    method: "POST",
    headers: key ? { Authorization: `Bearer ${key}` } : {},
  });
  if (reply.status === 401) throw new Error(key ? "the API key was not accepted" : "this server needs an API key");
  if (!reply.ok) throw new Error(`the client secret request failed (HTTP ${reply.status})`);
  const { value } = await reply.json();
  return ["realtime", `openai-insecure-api-key.${value}`];
}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

const VOICE_NAME = /^([A-Za-z0-9][A-Za-z0-9_-]{0,63}\.(pt|wav|flac|mp3|ogg)|[A-Za-z0-9_-]{1,64})$/;

// ---- voices: the list from GET /v1/voices, and enrollment when the server allows it --------

async function loadVoices(select) {
  const list = $("voice");
  const reply = { data: [], upload: false };
  try {
    let after = "";
    for (let page = 0; page < 20; page++) { // the list comes in pages (has_more, last_id)
      const r = await fetch(after ? `/v1/voices?after=${encodeURIComponent(after)}` : "/v1/voices", { cache: "no-store" });
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      const part = await r.json();
      reply.data.push(...part.data);
      reply.upload = part.upload;
      if (!part.has_more) break;
      after = part.last_id;
    }
  } catch (err) {
    showError(`the voice list could not be loaded (${err.message || err}): NATF2.pt is offered`);
    return;
  }
  const want = select || list.value;
  list.textContent = "";
  for (const v of reply.data) {
    const option = document.createElement("option");
    option.value = v.name;
    option.textContent = `${v.name} (${v.kind === "enrolled" ? "yours" : "bundled"}, ${v.seconds.toFixed(1)} s)`;
    option.dataset.kind = v.kind;
    list.append(option);
  }
  const names = reply.data.map((v) => v.name);
  list.value = names.includes(want) ? want : names.includes("NATF2.pt") ? "NATF2.pt" : names[0] || "";
  list.dataset.loaded = "true";
  $("enroll").hidden = !reply.upload;
}

function enrollStatus(text, failed = false) {
  const el = $("enroll-status");
  el.textContent = text;
  el.dataset.state = failed ? "error" : "ok";
}

async function enroll(blob) {
  const name = $("enroll-name").value.trim();
  if (!/^[A-Za-z0-9_-]{1,64}$/.test(name)) return enrollStatus("a name is 1 to 64 letters, digits, _ or -", true);
  enrollStatus(`uploading ${(blob.size / 1024).toFixed(0)} KiB …`);
  let r, reply;
  try {
    r = await fetch(`/v1/voices/${name}`, { method: "PUT", body: blob, headers: authHeaders() });
    reply = await r.json();
  } catch (err) {
    return enrollStatus(`the upload failed: ${err.message || err}`, true);
  }
  if (!r.ok) {
    const e = reply.error || {};
    return enrollStatus(`refused (${e.code || r.status}): ${e.message || ""}`, true);
  }
  await loadVoices(reply.name);
  enrollStatus(`${reply.name} is ready (${reply.seconds.toFixed(1)} s): press Talk`);
}

function wavFromPcm16(chunks, rate) {
  const samples = chunks.reduce((n, c) => n + c.byteLength / 2, 0);
  const out = new DataView(new ArrayBuffer(44 + 2 * samples));
  const text = (at, s) => [...s].forEach((ch, i) => out.setUint8(at + i, ch.charCodeAt(0)));
  text(0, "RIFF"); out.setUint32(4, 36 + 2 * samples, true); text(8, "WAVEfmt ");
  out.setUint32(16, 16, true); // fmt chunk: PCM, mono, `rate` Hz, 16 bits
  out.setUint16(20, 1, true);
  out.setUint16(22, 1, true);
  out.setUint32(24, rate, true);
  out.setUint32(28, 2 * rate, true);
  out.setUint16(32, 2, true);
  out.setUint16(34, 16, true);
  text(36, "data"); out.setUint32(40, 2 * samples, true);
  let at = 44;
  for (const c of chunks) {
    new Uint8Array(out.buffer, at, c.byteLength).set(new Uint8Array(c));
    at += c.byteLength;
  }
  return new Blob([out.buffer], { type: "audio/wav" });
}

// The microphone through the page's own 24 kHz capture worklet, as a WAV.
async function recordSeconds(seconds) {
  const ctx = new AudioContext();
  await ctx.audioWorklet.addModule("worklets.js");
  const stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
  const mic = new AudioWorkletNode(ctx, "mic-capture", {
    numberOfInputs: 1, numberOfOutputs: 1, outputChannelCount: [1],
  });
  const mute = ctx.createGain();
  mute.gain.value = 0;
  ctx.createMediaStreamSource(stream).connect(mic).connect(mute).connect(ctx.destination);
  const chunks = [];
  const wanted = Math.ceil((seconds * 1000) / FRAME_MS);
  await new Promise((done) => {
    mic.port.onmessage = (e) => {
      chunks.push(e.data.pcm);
      enrollStatus(`recording … ${((chunks.length * FRAME_MS) / 1000).toFixed(1)} s`);
      if (chunks.length >= wanted) done();
    };
    ctx.resume();
  });
  stream.getTracks().forEach((t) => t.stop());
  await ctx.close();
  return wavFromPcm16(chunks, WIRE_RATE);
}

$("enroll-upload").addEventListener("click", () => {
  const file = $("enroll-file").files[0];
  if (!file) return enrollStatus("choose an audio file first", true);
  enroll(file);
});

$("enroll-record").addEventListener("click", async () => {
  if (!window.isSecureContext || !navigator.mediaDevices) {
    return enrollStatus("recording needs a secure page (https or localhost)", true);
  }
  $("enroll-record").disabled = true;
  try {
    await enroll(await recordSeconds(5));
  } catch (err) {
    enrollStatus(`recording failed: ${err.message || err}`, true);
  } finally {
    $("enroll-record").disabled = false;
  }
});

function realtimeUrl() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}/v1/realtime?duplex=1`;
}

// ---- one conversation --------------------------------------------------------------

class Conversation {
  constructor({ voice, instructions }) {
    this.voice = voice;
    this.instructions = instructions;
    this.counts = { sent: 0, received: 0, played: 0, underruns: 0, dropped: 0, bufferedMs: 0 };
    this.pings = new Map(); // heartbeat event_id -> send time
    this.opened = false; // session.created arrived
    this.live = false; // opened and not yet over: mic audio is sent
    this.ended = false;
    this.closeWanted = false; // Stop was pressed: a close from here on is expected
  }

  async start() {
    // The AudioContext is made first, inside the click, so browsers allow it to play.
    this.ctx = new AudioContext();
    setState("starting");
    $("context-rate").textContent = `${this.ctx.sampleRate} Hz here, ${WIRE_RATE} Hz on the wire`;
    try {
      await this.ctx.audioWorklet.addModule("worklets.js");
      this.player = new AudioWorkletNode(this.ctx, "pcm-player", {
        numberOfInputs: 0,
        outputChannelCount: [1],
        processorOptions: { targetMs: JITTER_TARGET_MS, maxMs: JITTER_MAX_MS },
      });
      this.player.port.onmessage = (e) => this.onPlayerStats(e.data);
      this.player.connect(this.ctx.destination);
      this.stream = await navigator.mediaDevices.getUserMedia({
        audio: { channelCount: 1, echoCancellation: true, noiseSuppression: false, autoGainControl: false },
      });
    } catch (err) {
      if (this.ended) return; // Stop was pressed while audio was starting
      const what = err && err.name === "NotAllowedError" ? "the microphone was not allowed" : `audio could not start: ${err && err.message ? err.message : err}`;
      return this.fail(what);
    }
    if (this.ended) {
      this.stream.getTracks().forEach((t) => t.stop()); // Stop came while the browser asked for the mic
      return;
    }
    const source = this.ctx.createMediaStreamSource(this.stream);
    this.mic = new AudioWorkletNode(this.ctx, "mic-capture", { numberOfInputs: 1, numberOfOutputs: 1, outputChannelCount: [1] });
    this.mic.port.onmessage = (e) => this.onMicChunk(e.data);
    // Through a muted gain to the destination: the browser then keeps pulling the mic node.
    const mute = this.ctx.createGain();
    mute.gain.value = 0;
    source.connect(this.mic).connect(mute).connect(this.ctx.destination);
    await this.ctx.resume();
    if (!this.ended) this.connect();
  }

  async connect() {
    setState("connecting");
    let protocols;
    try {
      protocols = await socketProtocols();
    } catch (err) {
      return this.fail(`could not get a client secret: ${err && err.message ? err.message : err}`);
    }
    if (this.ended) return;
    this.ws = new WebSocket(realtimeUrl(), protocols);
    this.ws.onopen = () => {
      setState("opening");
      this.send({
        type: "session.update",
        session: {
          type: "realtime",
          output_modalities: ["audio", "text"],
          input_audio_format: "pcm16",
          output_audio_format: "pcm16",
          audio: { input: { format: { type: "audio/pcm", rate: WIRE_RATE } }, output: { format: { type: "audio/pcm", rate: WIRE_RATE } } },
          voice: this.voice,
          instructions: this.instructions,
          turn_detection: null,
        },
      });
    };
    this.ws.onmessage = (e) => this.onEvent(e.data);
    this.ws.onclose = (e) => this.onSocketClose(e);
  }

  send(event) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(event));
  }

  onMicChunk(msg) {
    // Meter ballistics: rise at once, fall gently, so short gaps between syllables do not blink.
    this.micRms = Math.max(msg.rms, 0.7 * (this.micRms || 0));
    this.micPeak = Math.max(msg.peak, 0.85 * (this.micPeak || 0));
    setMeter("mic", this.micRms, this.micPeak);
    if (!this.live || this.closeWanted) return; // before the session is open, mic audio is not sent
    this.send({ type: "input_audio_buffer.append", audio: base64FromBytes(msg.pcm) });
    this.counts.sent++;
  }

  onPlayerStats(s) {
    this.counts.played = s.framesPlayed;
    this.counts.underruns = s.underruns;
    this.counts.dropped = s.droppedFrames;
    this.counts.bufferedMs = s.bufferedMs;
    setMeter("model", s.rms, s.peak);
  }

  onEvent(data) {
    let ev;
    try {
      ev = JSON.parse(data);
    } catch {
      return showError("the server sent a message that is not JSON");
    }
    if (AUDIO_DELTAS.has(ev.type)) return this.onAudio(ev);
    if (TEXT_DELTAS.has(ev.type)) return this.onText(ev.delta);
    switch (ev.type) {
      case "session.created":
        this.opened = this.live = true;
        setState("live");
        {
          // The model's own delay: how far behind the output may be on a server that keeps up.
          const delay = ev.session && ev.session.capabilities && ev.session.capabilities.output_delay_frames;
          $("model-delay").textContent = Number.isInteger(delay) ? `; the model's own delay is ${delay}` : "";
        }
        this.heartbeat = setInterval(() => this.ping(), HEARTBEAT_MS);
        this.ping();
        break;
      case "session.heartbeat_ack": {
        const sent = this.pings.get(ev.client_event_id);
        if (sent !== undefined) {
          this.pings.delete(ev.client_event_id);
          $("rtt-ms").textContent = (performance.now() - sent).toFixed(0);
        }
        break;
      }
      case "error":
        this.onServerError(ev.error || {});
        break;
      case "response.done":
      case "session.closed":
        // The session is over (asked for, or ended by the server): no more audio goes out.
        this.live = false;
        if (ev.type === "session.closed") this.sessionClosed = true;
        if (ev.type === "session.closed" && this.closeWanted) this.ws.close(1000, "done");
        break;
      default:
        break; // session.updated, response.created, response.done, ...: nothing to show
    }
  }

  onAudio(ev) {
    if (typeof ev.delta !== "string") return;
    let pcm;
    try {
      pcm = bytesFromBase64(ev.delta);
    } catch {
      return showError("the server sent audio that is not valid base64");
    }
    if (pcm.byteLength % 2) return showError("the server sent audio with an odd number of bytes (not pcm16)");
    this.counts.received++;
    this.player.port.postMessage({ type: "frame", pcm }, [pcm]);
  }

  onText(piece) {
    if (typeof piece !== "string" || !piece) return;
    const box = $("transcript");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 24;
    box.textContent += piece.replaceAll("\u2581", " "); // SentencePiece word mark, should the server pass it through
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  onServerError(err) {
    const code = err.code ? ` [${err.code}]` : "";
    showError(`Server: ${err.message || "unknown error"}${code}`);
    if (!this.opened) {
      // Refused before the session opened (bad voice, server full, ...): nothing more can happen.
      this.fail(null);
    }
  }

  ping() {
    const id = `hb_${Math.random().toString(36).slice(2, 10)}`;
    this.pings.set(id, performance.now());
    if (this.pings.size > 30) this.pings.delete(this.pings.keys().next().value); // never answered: forget
    this.send({ type: "session.heartbeat", event_id: id });
  }

  onSocketClose(e) {
    if (this.ended) return;
    if (this.closeWanted && (this.sessionClosed || e.code === 1000)) {
      this.teardown("closed", `${this.counts.sent} frames sent, ${this.counts.received} received`);
      return;
    }
    if (this.sessionClosed && e.code === 1000) {
      this.teardown("closed", "the server ended the session");
      return;
    }
    if (!this.opened && e.code === 1006) {
      return this.fail(`could not connect to ${realtimeUrl()} (${describeClose(e.code, e.reason)})`);
    }
    this.fail(`Connection: ${describeClose(e.code, e.reason)}`);
  }

  stop() {
    if (this.ended || this.closeWanted) return;
    this.closeWanted = true;
    this.stopAudio();
    if (this.ws && this.ws.readyState === WebSocket.OPEN && this.opened && !this.sessionClosed) {
      setState("closing");
      this.send({ type: "session.close" });
      this.closeTimer = setTimeout(() => this.ws.close(1000, "client stop"), CLOSE_WAIT_MS);
    } else {
      if (this.ws) this.ws.close(1000, "client stop");
      this.teardown("closed");
    }
  }

  fail(message) {
    if (this.ended) return;
    if (message) showError(message);
    if (this.ws && this.ws.readyState <= WebSocket.OPEN) this.ws.close(1000, "client gave up");
    this.teardown("error");
  }

  stopAudio() {
    if (this.stream) this.stream.getTracks().forEach((t) => t.stop());
    if (this.mic) this.mic.port.onmessage = null;
    if (this.ctx && this.ctx.state !== "closed") this.ctx.close();
  }

  teardown(state, detail = "") {
    if (this.ended) return;
    this.ended = true;
    this.live = false;
    clearInterval(this.heartbeat);
    clearTimeout(this.closeTimer);
    this.stopAudio();
    setState(state, detail);
    onConversationEnded(this);
  }
}

// ---- page wiring -------------------------------------------------------------------

let current = null;

function render() {
  if (!current) return;
  const c = current.counts;
  $("sent-frames").textContent = c.sent;
  $("received-frames").textContent = c.received;
  $("played-frames").textContent = c.played;
  $("buffer-ms").textContent = c.bufferedMs.toFixed(0);
  $("underruns").textContent = c.underruns;
  $("dropped-frames").textContent = c.dropped;
  const lag = c.sent - c.received; // frames the model's output is behind our input
  $("lag-frames").textContent = lag;
  $("lag-ms").textContent = lag * FRAME_MS;
}

function onConversationEnded(conv) {
  render();
  if (current === conv) current = null;
  $("talk").disabled = false;
  $("stop").disabled = true;
}

$("talk").addEventListener("click", () => {
  if (current) return;
  const voice = $("voice").value.trim();
  if (!VOICE_NAME.test(voice)) {
    clearError();
    showError(`"${voice}" is not a voice name: pick one from the list`);
    return;
  }
  clearError();
  if (!window.isSecureContext || !navigator.mediaDevices || !window.AudioWorkletNode) {
    // Browsers give the microphone and audio worklets only to secure pages.
    showError(`The microphone only works on a secure page: open this page over https://, or as http://localhost:${location.port || 80}/ (an SSH tunnel works), not ${location.origin}.`);
    setState("error");
    return;
  }
  $("transcript").textContent = "";
  $("rtt-ms").textContent = "–";
  $("model-delay").textContent = "";
  $("talk").disabled = true;
  $("stop").disabled = false;
  current = new Conversation({ voice, instructions: $("persona").value });
  render();
  current.start();
});

$("stop").addEventListener("click", () => current && current.stop());
window.addEventListener("pagehide", () => current && current.stop());
$("api-key").value = sessionStorage.getItem("personaplex-api-key") || "";
setInterval(render, 100);
setState("idle");
loadVoices();
