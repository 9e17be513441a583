"""``python -m prefill_svc --help``: a worker in the prefill role."""
from worker.main import main
from decode_svc.role import DECODE
from prefill_svc.role import PREFILL

if __name__ == "__main__":
    # Every worker hosts both role modules so that its role can change without a restart.
    main("prefill", "pdserve prefill worker: chunked prefill, ships KV blocks to decode workers",
         modules=[PREFILL, DECODE])
