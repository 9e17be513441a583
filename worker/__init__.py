"""The worker process shared by both pools: one engine, a role that decides what it is given."""
