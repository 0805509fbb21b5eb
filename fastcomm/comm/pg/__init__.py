"""Communicators over a torch.distributed ProcessGroup (Gloo, or any group torch already made)."""
