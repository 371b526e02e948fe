// The Node.js `openai` SDK's Realtime client, unmodified, against the gateway over wss.
//
//   node realtime_wss.mjs --url https://127.0.0.1:PORT --speech in.wav --delay N [--transport ws|websocket]
//
// The SDK always builds a wss:// URL from its baseURL, so a gateway without TLS cannot be reached; the
// CA of the gateway's certificate is trusted the way a user trusts it (NODE_EXTRA_CA_CERTS) and the key
// comes from OPENAI_API_KEY. `ws`: OpenAIRealtimeWS (the `ws` package; the key as a bearer header).
// `websocket`: OpenAIRealtimeWebSocket on the `ws` package's WebSocket as the global one Node 20 lacks
// (the key as the openai-insecure-api-key subprotocol). Paced 80 ms pcm16 frames go in; a quarter of the
// way into phase B one response.cancel goes out. One JSON report line on stdout, as the Python clients'.

import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";
import OpenAI from "openai";
import { OpenAIRealtimeWS } from "openai/realtime/ws";
import { OpenAIRealtimeWebSocket } from "openai/realtime/websocket";
import { WebSocket } from "ws";

const FRAME = 1920; // 80 ms at 24 kHz
const PERIOD_MS = 80;
const { values: a } = parseArgs({ options: {
  url: { type: "string" }, speech: { type: "string" }, delay: { type: "string" },
  transport: { type: "string", default: "ws" },
  "frames-a": { type: "string", default: "25" }, "frames-b": { type: "string", default: "20" },
} });
const framesA = Number(a["frames-a"]), framesB = Number(a["frames-b"]), delay = Number(a.delay);

function readPcm16(path) {
  // A RIFF/WAVE file of 24 kHz mono int16: the samples of its "data" chunk.
  const buf = readFileSync(path);
  for (let off = 12; off + 8 <= buf.length;) {
    const id = buf.toString("ascii", off, off + 4), size = buf.readUInt32LE(off + 4);
    if (id === "data") return buf.subarray(off + 8, off + 8 + size);
    off += 8 + size + (size % 2);
  }
  throw new Error(`${path}: no data chunk`);
}

async function metric(name) {
  // Sum of one gateway metric over its labels (fetch trusts NODE_EXTRA_CA_CERTS too).
  const body = await (await fetch(`${a.url}/metrics`)).text();
  return body.split("\n").filter((l) => l.startsWith(`${name} `) || l.startsWith(`${name}{`))
    .reduce((sum, l) => sum + Number(l.slice(l.lastIndexOf(" ") + 1)), 0);
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
async function waitUntil(cond, ms) {
  const end = Date.now() + ms;
  while (!cond() && Date.now() < end) await sleep(20);
  return cond();
}

const pcm = readPcm16(a.speech);
const frame = (i) => pcm.subarray(i * FRAME * 2, (i + 1) * FRAME * 2).toString("base64");
// Read before the client exists: it connects at once, and with ?model= the gateway opens the session on
// the upgrade, which on a loaded machine lands before a metric read started after it.
const openedBefore = await metric("gateway_sessions_opened_total");
const framesInBefore = await metric("gateway_frames_in_total");
const client = new OpenAI({ baseURL: `${a.url}/v1` }); // apiKey: OPENAI_API_KEY
let rt;
if (a.transport === "websocket") {
  globalThis.WebSocket = WebSocket;
  rt = new OpenAIRealtimeWebSocket({ model: "personaplex" }, client);
} else {
  rt = new OpenAIRealtimeWS({ model: "personaplex" }, client);
}
const events = [], errors = [];
let received = 0;
rt.on("event", (ev) => {
  events.push(ev.type === "response.output_audio.delta" ? { ...ev, delta: ev.delta.slice(0, 8) } : ev);
  if (ev.type === "response.output_audio.delta") received += 1;
});
rt.on("error", (err) => errors.push(String(err.message ?? err).slice(0, 300)));
const socket = rt.socket;
const opened = new Promise((resolve, reject) => {
  const fail = (e) => reject(new Error(`connect failed: ${e.message ?? e}`));
  if (socket.on) { socket.on("open", resolve); socket.on("error", fail); } else {
    socket.addEventListener("open", resolve); socket.addEventListener("error", fail);
  }
});

async function paced(first, count, each) {
  const start = Date.now();
  for (let n = 0; n < count; n++) {
    await each(n);
    rt.send({ type: "input_audio_buffer.append", audio: frame(first + n) });
    await sleep(Math.max(0, start + (n + 1) * PERIOD_MS - Date.now()));
  }
  return count;
}

await opened;
rt.send({ type: "session.update", session: { type: "realtime", instructions: "You are a friendly pirate.",
  audio: { output: { voice: "NATF2.pt" } } } });
await waitUntil(() => events.some((e) => e.type === "session.updated"), 60_000);
const sentA = await paced(0, framesA, async () => {});
await waitUntil(() => received >= sentA - delay, 30_000);
const receivedA = received, serverFramesInA = (await metric("gateway_frames_in_total")) - framesInBefore;
let atCancel = 0;
await paced(framesA, framesB, async (n) => {
  if (n === Math.floor(framesB / 4)) { atCancel = received; rt.send({ type: "response.cancel" }); }
});
await waitUntil(() => received >= receivedA + framesB - delay - 2, 20_000);
const sessionsOpened = (await metric("gateway_sessions_opened_total")) - openedBefore;
rt.send({ type: "session.close" });
await waitUntil(() => events.some((e) => e.type === "session.closed"), 30_000);
rt.close();
process.stdout.write(JSON.stringify({ sent_a: sentA, received_a: receivedA, server_frames_in_a: serverFramesInA,
  received_after_interrupt: received - atCancel, texts: events.filter((e) => e.type.endsWith("transcript.delta")
    && e.delta).length, errors, sessions_opened: sessionsOpened, events, url: rt.url.toString() }) + "\n");
