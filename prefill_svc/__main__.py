"""``python -m prefill_svc --help``: a worker in the prefill role."""
from common.worker.main import main

if __name__ == "__main__":
    main("prefill", "pdserve prefill worker: chunked prefill, ships KV blocks to decode workers")
