"""pdctl: the operators' tool, a program of its own beside the gateway process.

    cli.py           the subcommands (status, drain, set-role, rebalance; plan and calibrate from
                     planner/, gen-secrets, rollout, scale, metrics-proxy from deploy/)
    admin_client.py  the gateway's admin API as pdctl calls it (AdminClient, AdminError)
    rebalance.py     how many prefill and decode workers the load needs (throughput rules)
    planner/         capacity planning by simulation on the real scheduler and router
    deploy/          compose env files, rolling replacement, drain-aware scaling, metrics relay

``python -m pdctl`` or the ``pdctl`` console script.
"""
