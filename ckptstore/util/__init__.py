"""Helpers every layer may use, with no knowledge of runs or saves:
:mod:`.redact` (credentials out of messages), :mod:`.terminal` (strings from
storage made safe to print), :mod:`.files` (directory fsync, atomic replace), :mod:`.progress` (a progress bar
on a terminal), :mod:`.prometheus` (metrics through prometheus-client)."""
