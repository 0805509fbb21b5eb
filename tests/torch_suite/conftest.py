"""The torch-suite module swaps torch's DDP class process-wide, so it is collected only when
asked for (``FASTCOMM_TORCH_SUITE=1``, as ``.ci/run`` does in its own pytest invocation)."""

import os

_WANTED = os.environ.get("FASTCOMM_TORCH_SUITE") == "1"
collect_ignore = [] if _WANTED else ["test_torch_ddp_suite.py"]
