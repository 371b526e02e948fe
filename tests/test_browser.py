"""The talk page in a real headless Chromium against the real local stack.

Chromium (Debian's, installed here with apt-get when missing) gets a generated speech-like WAV
as its fake microphone. Playwright drives the page the gateway serves at `/`: press Talk, and the
page must open a session, stream the microphone (the gateway's own frames-in counter grows),
play the model's audio (its played-frames counter grows, with a non-silent level), show the
model's transcript and a heartbeat round trip, and close cleanly on Stop. A voice the server
does not have, and a second tab while the only slot is taken, must come back as errors in plain
words, and the page must work after (and alongside) them.

The audio worklets (resampling to and from 24 kHz, 80 ms chunks, the jitter buffer) are also
checked on their own in the same browser, through an OfflineAudioContext, with exact numbers.

A screenshot of the live page is saved to test-artifacts/browser.png.
"""

from __future__ import annotations

import json
import math
import re
import ssl
import threading
import time
import urllib.request
import wave
from contextlib import contextmanager
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from tests.debian_packages import ensure_program
from tools.run_stack import GatewayProcess, Stack
from tools.tls_cert import make_local_tls, spki_sha256

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
STATIC = REPO / "services" / "gateway" / "static"
INSECURE_HOST = "insecure.test"


def ensure_chromium() -> Path:
    """Debian's chromium, installed with apt-get when missing."""
    return ensure_program(CHROMIUM, "chromium")


def write_speech_like_wav(path: Path, seconds: float = 4.0, rate: int = 48_000) -> Path:
    """Voiced 'syllables': a gliding pitch with harmonics shaped by two formant bumps,
    at about 4 syllables a second, with short pauses between words. 16-bit mono."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 40 * np.sin(2 * math.pi * 0.7 * t)  # intonation
    phase = 2 * math.pi * np.cumsum(f0) / rate
    formants = 650 + 350 * np.sin(2 * math.pi * 3.1 * t)  # the vowel changes
    voice = np.zeros_like(t)
    for k in range(1, 25):
        freq = k * f0
        gain = np.exp(-(((freq - formants) / 250) ** 2)) + 0.5 * np.exp(-(((freq - 2 * formants - 500) / 400) ** 2))
        voice += gain * np.sin(k * phase) / k**0.5
    syllables = np.clip(np.sin(2 * math.pi * 4.0 * t), 0, None) ** 0.6
    words = (np.sin(2 * math.pi * 0.45 * t) > -0.6).astype(float)  # a pause now and then
    signal = voice * syllables * words
    signal = 0.3 * signal / np.max(np.abs(signal))
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((signal * 32767).astype("<i2").tobytes())
    return path


def metric(base_url: str, name: str, labels: str = "") -> float:
    """One sample of the gateway's /metrics, e.g. metric(url, 'gateway_frames_in_total')."""
    text = urllib.request.urlopen(base_url + "/metrics", timeout=5).read().decode()
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0  # a labelled series not touched yet


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    # This machine is shared and slow: generous bounds for "a stage is stalled" and for opening.
    gateway_args = ["--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20"]
    with Stack(tiny_checkpoint, sessions=1, gateway_args=gateway_args) as running:
        yield running


@pytest.fixture
def static_server():
    """The static folder over a real local HTTP socket (for the worklet checks, which need no stack)."""
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # the page asks the gateway for its voices: answer as one with a single voice
            if self.path != "/v1/voices":
                return super().do_GET()
            body = json.dumps({"object": "list", "upload": False,
                               "data": [{"name": "NATF2.pt", "kind": "bundled", "seconds": 1.0}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(STATIC)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def page(tmp_path):
    with launched(tmp_path) as page:
        yield page


@contextmanager
def launched(tmp_path, extra_flags: tuple[str, ...] = ()):
    """A fresh headless Chromium with the fake microphone; yields its page."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: pip install -e '.[test]' (pyproject's test extra)")
    chromium = ensure_chromium()
    mic = write_speech_like_wav(tmp_path / "mic.wav")
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={mic}",
        # A name for 127.0.0.1 that is not a secure origin (localhost and 127.0.0.1 are).
        f"--host-resolver-rules=MAP {INSECURE_HOST} 127.0.0.1",
        *extra_flags,
    ]
    with sync_playwright() as pw:
        # A persistent context is how Playwright takes a --user-data-dir: a fresh one per test.
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(chromium), headless=True, args=flags,
            viewport={"width": 1100, "height": 720},
        )
        page = context.pages[0] if context.pages else context.new_page()
        page.problems = []  # uncaught page errors and console errors: a working page has none
        page.on("pageerror", lambda e: page.problems.append(f"page error: {e}"))
        page.on("console", lambda m: m.type == "error" and page.problems.append(f"console: {m.text}"))
        try:
            yield page
        finally:
            context.close()


def text_of(page, selector: str) -> str:
    return page.inner_text(selector).strip()


def wait_for(page, js: str, timeout_s: float, what: str) -> None:
    """Wait until the JS expression is true; on timeout say what was awaited and what the page shows."""
    try:
        page.wait_for_function(js, timeout=timeout_s * 1000, polling=100)
    except Exception:
        state = page.evaluate("document.getElementById('state').textContent")
        error = page.evaluate("document.getElementById('error').textContent")
        stats = page.evaluate("document.querySelector('.stats').innerText")
        raise AssertionError(f"timed out waiting for {what}; state={state!r} error={error!r}\n{stats}") from None


COUNTERS = ("sent-frames", "received-frames", "played-frames", "lag-frames", "lag-ms")


def counters(page) -> dict[str, int]:
    texts = page.evaluate(f"{list(COUNTERS)}.map((id) => document.getElementById(id).textContent)")
    return {name: int(text) for name, text in zip(COUNTERS, texts)}


# A fresh machine installs chromium first (apt-get, minutes): generous timeouts.
@pytest.mark.timeout(900)
def test_talk_from_the_browser(stack, page):
    base = stack.gateway.http_url
    page.goto(base + "/")
    assert page.title() == "PersonaPlex: talk"
    assert page.get_attribute("#state", "data-state") == "idle"
    # The voice list comes from the server (GET /v1/voices): the tiny checkpoint's bundled voices.
    wait_for(page, "document.getElementById('voice').dataset.loaded === 'true'", 30, "the voice list")
    options = page.evaluate("[...document.getElementById('voice').options].map((o) => o.value)")
    assert options == ["NATF2.pt", "NATM1.pt", "VARF0.pt"], options
    assert page.input_value("#voice") == "NATF2.pt"
    assert page.is_hidden("#enroll")  # this server takes no uploads

    # A voice this server does not have (gone since the list loaded): the refusal arrives as an error in
    # plain words, before any session.
    choose_unlisted(page, "NOSUCH1.pt")
    page.click("#talk")
    wait_for(page, "document.getElementById('state').dataset.state === 'error'", 30, "the refusal of an unknown voice")
    error = text_of(page, "#error")
    assert "NOSUCH1.pt" in error and "invalid_voice" in error, error
    assert page.is_enabled("#talk") and not page.is_enabled("#stop")

    # A malformed voice name is caught on the page itself, without a connection.
    choose_unlisted(page, "../etc/passwd")
    page.click("#talk")
    assert "is not a voice name" in text_of(page, "#error")
    assert page.get_attribute("#state", "data-state") == "error"

    # Now a real conversation on the same page.
    frames_in_before = metric(base, "gateway_frames_in_total")
    page.select_option("#voice", "NATF2.pt")
    page.fill("#persona", "You like browsers.")  # the tiny model's 32-frame window fits only a short persona
    t0 = time.monotonic()
    page.click("#talk")
    wait_for(page, "document.getElementById('state').dataset.state === 'live'", 60, "the session to open")
    assert page.is_hidden("#error")
    opened_s = time.monotonic() - t0
    wait_for(
        page,
        """(() => {
            const n = (id) => Number(document.getElementById(id).textContent);
            return n('sent-frames') >= 25 && n('played-frames') >= 5
                && Number(document.getElementById('model-level').dataset.peak) > 0
                && Number(document.getElementById('mic-level').dataset.peak) > 0.05  // the WAV peaks at 0.3
                && document.getElementById('transcript').textContent.trim().length > 0
                && /^[0-9]+$/.test(document.getElementById('rtt-ms').textContent);
        })()""",
        60,
        "25 frames sent, a loud mic chunk, 5 frames played (non-silent), some transcript and a heartbeat round trip",
    )
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser.png"))

    c = counters(page)  # one read, so the counters agree with each other
    sent, received, played = c["sent-frames"], c["received-frames"], c["played-frames"]
    # The microphone (the fake WAV) reached the server: the gateway's own counter grew.
    frames_in = metric(base, "gateway_frames_in_total") - frames_in_before
    assert frames_in >= 20 and sent >= 25, (frames_in, sent)
    # Model audio arrived and was played; output never runs ahead of input (read after `received`).
    assert played >= 5 and received >= played and received <= frames_in, (played, received, frames_in)
    model_rms = float(page.get_attribute("#model-level", "data-rms"))
    assert model_rms > 1e-3, model_rms  # the tiny random model's audio is around 0.08 rms
    lag = c["lag-frames"]
    assert lag == sent - received and c["lag-ms"] == 80 * lag, c
    assert re.fullmatch(r"-?[0-9]+ dBFS", text_of(page, "#mic-level"))
    # The model's delay comes from session.capabilities.
    assert re.fullmatch(r"; the model's own delay is [0-9]+", text_of(page, "#model-delay"))
    assert len(text_of(page, "#transcript")) > 0
    assert metric(base, "gateway_sessions_active", 'protocol="realtime"') == 1

    # A second tab while the only slot is taken: refused in plain words; the first conversation goes on.
    other = page.context.new_page()
    other.goto(base + "/")
    other.fill("#persona", "You like browsers.")
    other.click("#talk")
    wait_for(other, "document.getElementById('state').dataset.state === 'error'", 30, "the second tab to be refused")
    assert "resource_exhausted" in text_of(other, "#error"), text_of(other, "#error")
    other.close()
    assert page.get_attribute("#state", "data-state") == "live" and page.is_hidden("#error")

    # Stop: session.close, the server confirms, audio is torn down, the slot is free again.
    page.click("#stop")
    wait_for(page, "document.getElementById('state').dataset.state === 'closed'", 15, "the session to close")
    assert page.is_hidden("#error"), text_of(page, "#error")
    assert page.is_enabled("#talk") and not page.is_enabled("#stop")
    mic_after_stop = page.get_attribute("#mic-level", "data-rms")
    page.wait_for_timeout(400)  # five mic chunks' worth: the meter would move if the mic were still running
    assert page.get_attribute("#mic-level", "data-rms") == mic_after_stop
    # Appends are handled in order before session.close, so the server got exactly what the page sent.
    sent_total = counters(page)["sent-frames"]
    assert metric(base, "gateway_frames_in_total") - frames_in_before == sent_total
    deadline = time.monotonic() + 25  # the gateway may take up to its --cleanup-timeout (20 s) to release
    while metric(base, "gateway_sessions_active", 'protocol="realtime"') != 0:
        assert time.monotonic() < deadline, "the gateway still counts the session as active after Stop"
        time.sleep(0.2)
    assert page.problems == [], page.problems
    print(f"\nbrowser: session open {opened_s:.1f}s after Talk; at the screenshot: sent {sent}, received {received}, "
          f"played {played}, "
          f"lag {lag} frames, rtt {text_of(page, '#rtt-ms')} ms, model rms {model_rms:.2e}; {sent_total} sent in all")


@pytest.mark.timeout(900)
def test_the_page_talks_to_a_gateway_with_an_api_key(stack, page):
    """A gateway with an API key: the page without the key says so in plain words; with the key
    typed in, it mints a short-lived client secret and connects with it as the WebSocket
    subprotocol (a browser WebSocket cannot send an Authorization header), and frames flow."""
    key = "browser-test-key"
    gw = GatewayProcess(stack.cell_procs[0].spec, args=["--stall-timeout", "30", "--open-timeout", "120"],
                        env={"PERSONAPLEX_GATEWAY_API_KEY": key}).start()
    try:
        page.goto(gw.http_url + "/")
        page.fill("#persona", "You like browsers.")
        page.click("#talk")
        wait_for(page, "document.getElementById('state').dataset.state === 'error'", 30, "the refusal without a key")
        assert "needs an API key" in text_of(page, "#error"), text_of(page, "#error")
        page.fill("#api-key", "wrong")
        page.click("#talk")
        wait_for(page, "document.getElementById('error').textContent.includes('not accepted')", 30,
                 "a wrong key refused")
        page.fill("#api-key", key)
        page.click("#talk")
        wait_for(page, "document.getElementById('state').dataset.state === 'live'", 60,
                 "the session to open with the key")
        wait_for(page, "Number(document.getElementById('received-frames').textContent) >= 3", 60,
                 "frames from the model")
        assert metric(gw.http_url, "gateway_sessions_active", 'protocol="realtime"') == 1
        page.click("#stop")
        wait_for(page, "document.getElementById('state').dataset.state === 'closed'", 15, "the session to close")
        # The browser logs each refused client-secret request (the two tries without a good key), nothing else.
        assert [p for p in page.problems if "status of 401" not in p] == [] and len(page.problems) == 2, page.problems
    finally:
        gw.stop()


@pytest.mark.timeout(900)
def test_the_page_talks_over_https_from_another_machines_name(stack, tmp_path):
    """Served by a gateway with --tls-cert/--tls-key under a name that is not this machine's (the
    microphone needs a secure page anywhere but localhost): the page is a secure context, talks over
    wss, plays the model's audio and closes cleanly. The certificate is made now, for that name, and
    trusted by this one browser profile only."""
    tls = make_local_tls(tmp_path / "tls", (INSECURE_HOST, "127.0.0.1"))
    gw = GatewayProcess(stack.cell_procs[0].spec, tls=tls, args=["--stall-timeout", "30", "--open-timeout", "120",
                                                                 "--cleanup-timeout", "20"]).start()
    try:
        with launched(tmp_path, (f"--ignore-certificate-errors-spki-list={spki_sha256(tls.cert)}",)) as page:
            page.goto(f"https://{INSECURE_HOST}:{gw.port}/")
            assert page.evaluate("window.isSecureContext && location.protocol") == "https:"
            page.fill("#persona", "You like browsers.")
            page.click("#talk")
            wait_for(page, "document.getElementById('state').dataset.state === 'live'", 60, "the session to open")
            wait_for(page, "Number(document.getElementById('played-frames').textContent) >= 5"
                           " && Number(document.getElementById('model-level').dataset.peak) > 0", 60,
                     "5 frames played, not silent")
            trust = ssl.create_default_context(cafile=tls.ca)
            scrape = urllib.request.urlopen(gw.http_url + "/metrics", timeout=5, context=trust).read().decode()
            assert 'gateway_sessions_active{protocol="realtime"} 1.0' in scrape  # its audio came over wss
            page.click("#stop")
            wait_for(page, "document.getElementById('state').dataset.state === 'closed'", 30, "the session to close")
            assert page.is_hidden("#error") and page.problems == [], page.problems
    finally:
        gw.stop()


def choose_unlisted(page, name: str) -> None:
    page.evaluate("""(name) => {
        const list = document.getElementById('voice');
        list.add(new Option(name, name));
        list.value = name;
    }""", name)


@pytest.mark.timeout(600)
def test_enroll_a_voice_from_a_file_and_the_microphone_then_talk_with_it(stack, page, tmp_path):
    """A gateway with --voice-upload and an API key on the same cell: the page shows the enrollment
    panel, enrolls a WAV file and then 5 s of its microphone, selects each at once, and talks with it
    (the key goes with the WebSocket as a subprotocol)."""
    key = "browser-key-7"
    gw = GatewayProcess(stack.cell_procs[0].spec, env={"BROWSER_GW_KEY": key}, args=[
        "--stall-timeout", "30", "--open-timeout", "120", "--cleanup-timeout", "20", "--api-key-env", "BROWSER_GW_KEY",
        "--voice-upload", "--voices-dir", str(tmp_path / "voices")]).start()
    try:
        page.goto(gw.http_url + "/")
        wait_for(page, "document.getElementById('voice').dataset.loaded === 'true'", 30, "the voice list")
        assert page.is_visible("#enroll")
        page.click("#enroll summary")
        page.fill("#api-key", "wrong")
        page.fill("#enroll-name", "fromfile")
        page.set_input_files("#enroll-file", str(write_speech_like_wav(tmp_path / "me.wav", seconds=2.5)))
        page.click("#enroll-upload")
        wait_for(page, "document.getElementById('enroll-status').dataset.state === 'error'", 30,
                 "the wrong key refused")
        assert "unauthorized" in text_of(page, "#enroll-status")
        assert page.problems and all("401" in p for p in page.problems), page.problems  # Chromium logs the 401
        page.problems.clear()

        page.fill("#api-key", key)
        page.click("#enroll-upload")
        wait_for(page, "document.getElementById('voice').value === 'fromfile'", 30, "the file's voice selected")
        assert "fromfile is ready" in text_of(page, "#enroll-status")
        page.fill("#enroll-name", "frommic")
        page.click("#enroll-record")
        wait_for(page, "document.getElementById('voice').value === 'frommic'", 40, "the recorded voice selected")
        listing = json.loads(urllib.request.urlopen(gw.http_url + "/v1/voices", timeout=10).read())
        enrolled = {v["name"]: v["seconds"] for v in listing["data"] if v["kind"] == "enrolled"}
        assert set(enrolled) == {"fromfile", "frommic"} and enrolled["frommic"] >= 4.9, enrolled

        page.fill("#persona", "Hi.")
        page.click("#talk")
        wait_for(page, "document.getElementById('state').dataset.state === 'live'", 90,
                 "the session with the new voice")
        wait_for(page, "Number(document.getElementById('played-frames').textContent) >= 5", 60, "5 frames played")
        page.click("#stop")
        wait_for(page, "document.getElementById('state').dataset.state === 'closed'", 30, "the session to close")
        assert page.problems == [], page.problems
    finally:
        gw.stop()


# ---- the worklets alone, in an OfflineAudioContext (rendered as fast as the CPU allows) ----------

MIC_JS = """async ({freq, rate, seconds}) => {
    const ctx = new OfflineAudioContext(1, Math.round(rate * seconds), rate);
    await ctx.audioWorklet.addModule('worklets.js');
    const osc = new OscillatorNode(ctx, {frequency: freq});
    const mic = new AudioWorkletNode(ctx, 'mic-capture',
        {numberOfInputs: 1, numberOfOutputs: 1, outputChannelCount: [1]});
    const chunks = [];
    mic.port.onmessage = (e) => chunks.push(
        {bytes: e.data.pcm.byteLength, pcm: Array.from(new Int16Array(e.data.pcm)), rms: e.data.rms});
    osc.connect(new GainNode(ctx, {gain: 0.5})).connect(mic).connect(ctx.destination);
    osc.start();
    await ctx.startRendering();
    await new Promise((r) => setTimeout(r, 200));  // the last port messages
    return chunks;
}"""

# 24 kHz frames -> pcm-player (jitter buffer, resampled to the context rate) -> mic-capture (back to
# 24 kHz): what the player played, as the page would send it.
LOOPBACK_JS = """async ({frames, rate, seconds, targetMs, maxMs}) => {
    const ctx = new OfflineAudioContext(1, Math.round(rate * seconds), rate);
    await ctx.audioWorklet.addModule('worklets.js');
    const player = new AudioWorkletNode(ctx, 'pcm-player',
        {numberOfInputs: 0, outputChannelCount: [1], processorOptions: {targetMs, maxMs}});
    const mic = new AudioWorkletNode(ctx, 'mic-capture',
        {numberOfInputs: 1, numberOfOutputs: 1, outputChannelCount: [1]});
    const chunks = [];
    let stats = null;
    mic.port.onmessage = (e) => chunks.push(...new Int16Array(e.data.pcm));
    player.port.onmessage = (e) => { stats = e.data; };
    player.connect(mic).connect(ctx.destination);
    ctx.suspend(1024 / rate).then(async () => {
        for (let f = 0; f < frames; f++) {
            const pcm = new ArrayBuffer(2 * 1920), view = new DataView(pcm);
            for (let i = 0; i < 1920; i++) {
                const t = (f * 1920 + i) / 24000;
                view.setInt16(2 * i, Math.round(0.5 * 32767 * Math.sin(2 * Math.PI * 440 * t)), true);
            }
            player.port.postMessage({type: 'frame', pcm}, [pcm]);
        }
        await new Promise((r) => setTimeout(r, 100));  // delivered to the audio thread before it renders on
        ctx.resume();
    });
    await ctx.startRendering();
    await new Promise((r) => setTimeout(r, 200));
    return {pcm: chunks, stats};
}"""


def dominant_hz(x: np.ndarray, rate: int = 24_000) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum) * rate / len(x))


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))


@pytest.mark.timeout(900)
def test_worklets_resample_chunk_and_buffer(page, static_server):
    page.goto(static_server + "/index.html")
    for rate in (48_000, 44_100):
        # 1 s of a 1 kHz sine at amplitude 0.5: twelve 80 ms chunks of 1920 pcm16 samples at 24 kHz.
        chunks = page.evaluate(MIC_JS, {"freq": 1000, "rate": rate, "seconds": 1.0})
        assert [c["bytes"] for c in chunks] == [3840] * 12, (rate, [c["bytes"] for c in chunks])
        x = np.concatenate([np.array(c["pcm"], dtype=np.float64) for c in chunks])[200:] / 32768
        assert abs(dominant_hz(x) - 1000) < 15, (rate, dominant_hz(x))
        assert abs(rms(x) - 0.5 / math.sqrt(2)) < 0.02, (rate, rms(x))
        assert all(abs(c["rms"] - 0.354) < 0.03 for c in chunks[1:]), [c["rms"] for c in chunks]
        # 18 kHz cannot be carried at 24 kHz: the low-pass must remove it, not fold it down to 6 kHz.
        chunks = page.evaluate(MIC_JS, {"freq": 18_000, "rate": rate, "seconds": 0.5})
        aliased = np.concatenate([np.array(c["pcm"], dtype=np.float64) for c in chunks])[200:] / 32768
        assert rms(aliased) < 0.01, (rate, rms(aliased))

    # Twelve model frames (0.96 s of 440 Hz) come back out of the player whole and in tune.
    out = page.evaluate(LOOPBACK_JS, {"frames": 12, "rate": 44_100, "seconds": 1.5, "targetMs": 160, "maxMs": 2000})
    stats, y = out["stats"], np.array(out["pcm"], dtype=np.float64) / 32768
    assert stats["framesIn"] == 12 and stats["framesPlayed"] == 12 and stats["droppedFrames"] == 0, stats
    # It ran dry once, at the end.
    assert stats["underruns"] == 1 and stats["bufferedMs"] == 0 and not stats["playing"], stats
    voiced = np.flatnonzero(np.abs(y) > 0.05)
    assert abs((voiced[-1] - voiced[0]) / 24_000 - 0.96) < 0.01, (voiced[0], voiced[-1])
    played = y[voiced[0]:voiced[-1]]
    assert abs(dominant_hz(played) - 440) < 10 and abs(rms(played) - 0.5 / math.sqrt(2)) < 0.02

    # Twenty frames at once with a 600 ms cap: the oldest are dropped so latency stays bounded.
    out = page.evaluate(LOOPBACK_JS, {"frames": 20, "rate": 44_100, "seconds": 1.5, "targetMs": 160, "maxMs": 600})
    assert out["stats"]["droppedFrames"] == 13 and out["stats"]["framesPlayed"] == 7, out["stats"]
    # Served over plain http from a host that is not this machine, the browser withholds the
    # microphone: the page says why and what to do instead of failing obscurely.
    page.goto(static_server.replace("127.0.0.1", INSECURE_HOST) + "/index.html")
    page.click("#talk")
    assert "only works on a secure page" in text_of(page, "#error")
    assert page.get_attribute("#state", "data-state") == "error" and page.is_enabled("#talk")
    assert page.problems == [], page.problems
