"""The suite's rows: one module per measurement, each with ``run(cfg) -> list[Row]``
(listed in :data:`bench.suite.ROWS`)."""
