"""The defaults several layers share, each written once.

The budget figures are the receipt-model seed's (``shared/seeds``): a 23
GPU-hour budget, 0.1 GPU-hour per step, 0.25 GPU-hour per restart (start-up
and loading). The gc grace is how long an uncommitted save counts as still in
progress: longer than the longest save, so gc never deletes what a live
writer is about to publish.
"""

#: a run's budget, in GPU-hours
BUDGET_GPU_HOURS = 23.0
#: what one training step costs, in GPU-hours
GPU_HOURS_PER_STEP = 0.1
#: what one restart costs before the first useful step, in GPU-hours
RESTART_GPU_HOURS = 0.25
#: seconds an uncommitted save counts as in progress (gc, leftovers, list_saves)
DEFAULT_GRACE_SECONDS = 3600.0
