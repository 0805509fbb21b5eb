"""The torch-suite modules each import torch's ``distributed_test`` with a ``BACKEND`` of their
own (and the DDP one swaps torch's DDP class process-wide), so each is collected only when
asked for, in a pytest run of its own, as ``.ci/run`` does:

- ``FASTCOMM_TORCH_SUITE=1``: ``test_torch_ddp_suite.py`` (fastcomm's DDP in torch's DDP tests);
- ``FASTCOMM_TORCH_COLLECTIVES_SUITE=1``: ``test_torch_collectives_suite.py`` (torch's
  collective tests on the ``fastcomm`` backend).
"""

import os

_SUITES = {
    "test_torch_ddp_suite.py": "FASTCOMM_TORCH_SUITE",
    "test_torch_collectives_suite.py": "FASTCOMM_TORCH_COLLECTIVES_SUITE",
}
collect_ignore = [name for name, flag in _SUITES.items() if os.environ.get(flag) != "1"]
