"""``python -m decode_svc --help``: a worker in the decode role."""
from common.worker.main import main

if __name__ == "__main__":
    main("decode", "pdserve decode worker: receives KV, continuous-batched decode, streams tokens")
