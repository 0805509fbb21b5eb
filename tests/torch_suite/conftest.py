"""The torch-suite module swaps torch's DDP class process-wide, so it is collected only when
asked for (``FASTCOMM_TORCH_SUITE=1``, as ``.ci/run`` does in its own pytest invocation)."""

import os

collect_ignore = [] if os.environ.get("FASTCOMM_TORCH_SUITE") == "1" else ["test_torch_ddp_suite.py"]
