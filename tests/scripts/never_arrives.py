"""Rank 1 never submits its allreduce; rank 0 must abort the job naming rank 1."""
import time

import numpy as np

import gradfuse

gradfuse.init()
if gradfuse.rank() == 1:
    time.sleep(120)
else:
    gradfuse.Pipeline().allreduce([np.ones(3, np.float32)])
print("unreachable: the allreduce should have aborted")
