"""python -m services.decoder --checkpoint DIR [--port 50053] [--metrics-port 9103] [--slots N] [--device cpu|cuda]

Every option also reads from DECODER_<NAME> (e.g. DECODER_SLOTS=8); `--help` lists them.
"""

from services.codec.stage import run_main
from services.decoder.config import DecoderConfig
from services.decoder.server import build

if __name__ == "__main__":
    run_main(build, DecoderConfig.load())
