"""Studies: one-off measurements outside the suite (run with ``./dev bench study NAME``)."""
