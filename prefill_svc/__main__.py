"""``python -m prefill_svc --help``: a worker in the prefill role (it hosts every role module)."""
from worker.main import main

if __name__ == "__main__":
    main("prefill", "pdserve prefill worker: chunked prefill, ships KV blocks to decode workers")
