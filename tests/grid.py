"""How much of the exhaustive sweeps a run covers (see tests/conftest.py).

By default each sweep runs a subset chosen to still prove its claim (every k, drafter, sampling
configuration and path at least once); ``SPECDEC_FULL_GRID=1`` runs every combination, which takes
several times longer (benchmarks and release checks run it).
"""
from __future__ import annotations

import os

FULL_GRID = os.environ.get("SPECDEC_FULL_GRID", "") == "1"
