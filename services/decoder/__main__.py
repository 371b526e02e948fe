"""python -m services.decoder --checkpoint DIR --port 50053 --metrics-port 9103 --slots 16 --device cpu"""

from services.codec.stage import run_main
from services.decoder.config import from_args
from services.decoder.server import build

if __name__ == "__main__":
    run_main(build, from_args())
