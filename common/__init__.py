"""What every process below the top floor uses: the engine (``engine/``) and the cluster plumbing
(``cluster/``: auth, flags, HTTP limits, messages, Redis registry and prefix index, child processes)."""
