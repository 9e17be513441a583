"""The local launcher: ``python -m launcher`` (``make up``) runs a gateway and workers on this
machine and keeps them running; the tests and benchmarks build their stacks with it too.

    local_stack.py  LocalStack: start, restart, stop (drained) the processes of one stack
    supervisor.py   restart what exits, with backoff; give up a crash loop
    run.py          the flags, and the life cycle of make up (start, supervise, stop on signals)
"""
