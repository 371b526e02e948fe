"""python -m services.encoder --checkpoint DIR --port 50051 --metrics-port 9101 --slots 16 --device cpu"""

from services.codec.stage import run_main
from services.encoder.config import from_args
from services.encoder.server import build

if __name__ == "__main__":
    run_main(build, from_args())
