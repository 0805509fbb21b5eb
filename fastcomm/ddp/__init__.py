"""Drop-in DistributedDataParallel with bucketed, overlapped allreduce."""
