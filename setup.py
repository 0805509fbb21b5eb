"""Builds the shm communicator's compiled core (``fastcomm/comm/shm/_core.c``) where it can.

The extension is optional: without a C compiler (or off Linux) the install still succeeds and
the communicator runs its pure-Python path. Metadata lives in ``pyproject.toml``.
"""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "fastcomm.comm.shm._core",
            ["fastcomm/comm/shm/_core.c"],
            # -ffp-contract=off: no a*s + b fused into one FMA (torch rounds the two apart)
            extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-fno-strict-aliasing"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
