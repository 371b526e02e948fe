"""python -m services.encoder --checkpoint DIR [--port 50051] [--metrics-port 9101] [--slots N] [--device cpu|cuda]

Every option also reads from ENCODER_<NAME> (e.g. ENCODER_SLOTS=8); `--help` lists them.
"""

from services.codec.stage import run_main
from services.encoder.config import EncoderConfig
from services.encoder.server import build

if __name__ == "__main__":
    run_main(build, EncoderConfig.load())
