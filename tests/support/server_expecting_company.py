"""`python -m tests.support.server_expecting_company ARGS` (from the repository's root): the real server
(`service.cli.main`: its signals, drain and exit status) with the two inputs of lingering that
depend on the machine fixed, so a test knows which inputs linger without relying on its speed:
the arrival predictor always expects another input within the wait, and batches are planned by
padded tokens instead of the latencies measured when the artifact was compiled."""

from __future__ import annotations

import math

from artifact.costs import unmeasured_costs
from service.admission import InputQueue
from service.backends import TvmBackend
from service.cli import main

InputQueue.arrival_rate = lambda self: math.inf
TvmBackend.costs = lambda self: unmeasured_costs(self.buckets)

if __name__ == "__main__":
    raise SystemExit(main())
