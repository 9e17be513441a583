"""``python -m decode_svc --help``: a worker in the decode role (it hosts every role module)."""
from worker.main import main

if __name__ == "__main__":
    main("decode", "pdserve decode worker: receives KV, continuous-batched decode, streams tokens")
