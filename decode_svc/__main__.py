"""``python -m decode_svc --help``: a worker in the decode role."""
from worker.main import main
from decode_svc.role import DECODE
from prefill_svc.role import PREFILL

if __name__ == "__main__":
    # Every worker hosts both role modules so that its role can change without a restart.
    main("decode", "pdserve decode worker: receives KV, continuous-batched decode, streams tokens",
         modules=[PREFILL, DECODE])
