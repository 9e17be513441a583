"""Tensor parallelism: one model across ranks of a ``torch.distributed`` group (``tensor_parallel``)."""
