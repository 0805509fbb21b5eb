"""Kernel collectives for ranks on one node: peers' buffers mapped into each process."""
