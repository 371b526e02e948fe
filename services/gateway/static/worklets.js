// AudioWorklet processors for the talk page (loaded with audioContext.audioWorklet.addModule).
//
//   mic-capture  microphone at the context rate -> pcm16 mono 24 kHz, posted in 80 ms chunks
//                (1920 samples) with the chunk's level.
//   pcm-player   model audio (pcm16 24 kHz frames from the main thread) -> the speakers at the
//                context rate, through a jitter buffer: playback starts once `targetMs` is queued,
//                an underrun goes back to buffering, and a queue past `maxMs` drops the oldest
//                audio so latency cannot grow without bound.
//
// Both run on the audio thread; they talk to the page only through their MessagePort.

const WIRE_RATE = 24000;
const FRAME = 1920; // samples per 80 ms frame at 24 kHz

// Streaming resampler: windowed-sinc low-pass (only when going down in rate, against
// aliasing) then linear interpolation. Keeps its state across calls, so chunk edges are seamless.
class Resampler {
  constructor(inRate, outRate) {
    this.step = inRate / outRate; // input samples per output sample
    this.identity = inRate === outRate;
    this.pending = new Float32Array(0); // filtered input not yet passed
    this.pos = 0; // fractional read position in `pending`
    this.taps = outRate < inRate ? lowpass(0.45 * outRate / inRate, 31) : null;
    this.history = this.taps ? new Float32Array(this.taps.length - 1) : null;
  }

  process(input) {
    if (this.identity) return Float32Array.from(input);
    const x = this.taps ? this.filter(input) : input;
    const buf = new Float32Array(this.pending.length + x.length);
    buf.set(this.pending);
    buf.set(x, this.pending.length);
    const out = [];
    let pos = this.pos;
    while (pos + 1 < buf.length) {
      const i = Math.floor(pos);
      const f = pos - i;
      out.push(buf[i] * (1 - f) + buf[i + 1] * f);
      pos += this.step;
    }
    const used = Math.min(Math.floor(pos), buf.length);
    this.pending = buf.slice(used);
    this.pos = pos - used;
    return Float32Array.from(out);
  }

  filter(input) {
    const taps = this.taps;
    const h = this.history.length;
    const x = new Float32Array(h + input.length);
    x.set(this.history);
    x.set(input, h);
    const y = new Float32Array(input.length);
    for (let n = 0; n < input.length; n++) {
      let acc = 0;
      for (let k = 0; k < taps.length; k++) acc += taps[k] * x[n + h - k];
      y[n] = acc;
    }
    this.history = x.slice(x.length - h);
    return y;
  }
}

// Hann-windowed sinc low-pass; `cutoff` is a fraction of the input rate (0..0.5).
function lowpass(cutoff, n) {
  const taps = new Float32Array(n);
  const mid = (n - 1) / 2;
  let sum = 0;
  for (let i = 0; i < n; i++) {
    const t = i - mid;
    const sinc = t === 0 ? 2 * cutoff : Math.sin(2 * Math.PI * cutoff * t) / (Math.PI * t);
    const hann = 0.5 - 0.5 * Math.cos((2 * Math.PI * i) / (n - 1));
    taps[i] = sinc * hann;
    sum += taps[i];
  }
  for (let i = 0; i < n; i++) taps[i] /= sum;
  return taps;
}

function level(samples) {
  let sq = 0;
  let peak = 0;
  for (const s of samples) {
    sq += s * s;
    peak = Math.max(peak, Math.abs(s));
  }
  return { rms: samples.length ? Math.sqrt(sq / samples.length) : 0, peak };
}

class MicCapture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.resampler = new Resampler(sampleRate, WIRE_RATE);
    this.chunk = new Float32Array(FRAME);
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true; // no input connected yet (or the track ended): keep running
    const at24k = this.resampler.process(channel);
    let off = 0;
    while (off < at24k.length) {
      const n = Math.min(FRAME - this.filled, at24k.length - off);
      this.chunk.set(at24k.subarray(off, off + n), this.filled);
      this.filled += n;
      off += n;
      if (this.filled === FRAME) this.emit();
    }
    return true;
  }

  emit() {
    const pcm = new ArrayBuffer(2 * FRAME);
    const view = new DataView(pcm); // the wire is little-endian whatever this machine is
    for (let i = 0; i < FRAME; i++) {
      const s = Math.max(-1, Math.min(1, this.chunk[i]));
      view.setInt16(2 * i, s < 0 ? Math.round(s * 0x8000) : Math.round(s * 0x7fff), true);
    }
    const { rms, peak } = level(this.chunk);
    this.port.postMessage({ type: "chunk", pcm, rms, peak }, [pcm]);
    this.filled = 0;
  }
}

class PcmPlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = (options && options.processorOptions) || {};
    this.targetSamples = Math.round(((o.targetMs || 160) / 1000) * sampleRate);
    this.maxSamples = Math.round(((o.maxMs || 600) / 1000) * sampleRate);
    this.resampler = new Resampler(WIRE_RATE, sampleRate);
    this.queue = []; // [{samples: Float32Array (context rate), off: number}]
    this.queued = 0; // samples in `queue` not yet played
    this.playing = false;
    this.stats = { framesIn: 0, framesPlayed: 0, underruns: 0, droppedFrames: 0, rms: 0, peak: 0 };
    this.sinceReport = 0;
    this.port.onmessage = (e) => this.push(e.data);
  }

  push(msg) {
    if (msg.type !== "frame") return;
    const view = new DataView(msg.pcm);
    const f = new Float32Array(msg.pcm.byteLength >> 1);
    for (let i = 0; i < f.length; i++) f[i] = view.getInt16(2 * i, true) / 0x8000;
    const samples = this.resampler.process(f);
    this.queue.push({ samples, off: 0 });
    this.queued += samples.length;
    this.stats.framesIn++;
    while (this.queued > this.maxSamples && this.queue.length > 1) {
      const old = this.queue.shift(); // too far behind: drop the oldest frame to catch up
      this.queued -= old.samples.length - old.off;
      this.stats.droppedFrames++;
    }
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    out.fill(0);
    if (!this.playing && this.queued >= this.targetSamples) this.playing = true;
    let written = 0;
    if (this.playing) {
      while (written < out.length && this.queue.length) {
        const head = this.queue[0];
        const n = Math.min(out.length - written, head.samples.length - head.off);
        out.set(head.samples.subarray(head.off, head.off + n), written);
        head.off += n;
        written += n;
        this.queued -= n;
        if (head.off === head.samples.length) {
          this.queue.shift();
          this.stats.framesPlayed++;
        }
      }
      if (written < out.length) {
        this.playing = false; // ran dry: rebuild the jitter buffer before playing again
        this.stats.underruns++;
      }
    }
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    const { rms, peak } = level(out.subarray(0, written));
    if (written) {
      // Smoothed level of what was actually played (silence while buffering does not count).
      this.stats.rms = 0.8 * this.stats.rms + 0.2 * rms;
      this.stats.peak = Math.max(this.stats.peak * 0.95, peak);
    }
    this.sinceReport += out.length;
    if (this.sinceReport >= sampleRate / 10) {
      this.sinceReport = 0;
      this.port.postMessage({ type: "stats", ...this.stats, bufferedMs: (1000 * this.queued) / sampleRate, playing: this.playing });
    }
    return true;
  }
}

registerProcessor("mic-capture", MicCapture);
registerProcessor("pcm-player", PcmPlayer);
