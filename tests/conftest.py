"""Test-wide settings. The Triton interpreter must be chosen before triton is imported anywhere."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
