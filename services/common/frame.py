"""The frame contract every service, tool and benchmark shares: 24 kHz mono audio in 80 ms frames of
1920 samples; a frame is one Mimi code frame (8 codebooks of 2048 entries) and one model step."""

SAMPLE_RATE = 24_000
FRAME_SAMPLES = 1920
FRAME_MS = 80
FRAME_S = FRAME_MS / 1000
CODEBOOKS = 8
CARD = 2048
