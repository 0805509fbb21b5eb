"""fastcomm-run: torchrun-compatible elastic launcher."""
