"""Cluster plumbing every process uses: the cluster secret and request signing (auth), flags that
read ``PDSERVE_*``, bounded HTTP listeners, the internal messages, the Redis registry and prefix
index, and child processes."""
