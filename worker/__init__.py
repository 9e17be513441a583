"""The worker process shared by both pools: one engine, the KV endpoints and the registry
heartbeat, hosting the role modules of ``prefill_svc`` and ``decode_svc``.

    main.py          the entry point behind python -m prefill_svc / decode_svc; signals, exit status
    lifecycle.py     Worker: start, stop, registry, drain, role changes
    role_context.py  RoleContext, what a role module may use; RoleModule
    in_flight.py     the requests in flight, until everything they held is released
    admin_routes.py  /abort, /health, /stats, /metrics, /admin/*
    engine_thread.py the engine's own thread: commands between steps, streams, the watchdog
    config.py        flags and PDSERVE_* variables -> WorkerConfig
"""
