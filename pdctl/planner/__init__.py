"""Capacity planning: simulate a deployment on the project's own scheduler and router.

    hardware.py    GPU and link profiles, model sizes (built-in table or a config.json)
    cost_model.py  step time from a step's shape: roofline (profile) or linear (calibrated)
    calibrate.py   pdctl calibrate: time the real engine on a grid of shapes, fit; serving overheads
    live.py        a running deployment's step logs: pdctl calibrate --live, the machine's speed now
    traffic.py     synthetic traffic (rate, Poisson/gamma, lengths, shared prompts) and traces
    simulator.py   the discrete-event simulation (real Scheduler, BlockPool, Router)
    metrics.py     percentiles, goodput, KV usage, preemptions, transfers (loadgen's definitions)
    search.py      fluid bound, candidate splits, sampled slices of large clusters, recommendation
    rebalance_sim.py  pdctl rebalance --gpu/--calibration: the split chosen by simulation
    report.py      table and PNG
    cli.py         the pdctl plan / calibrate flags (pdctl/cli.py only registers them)
"""
