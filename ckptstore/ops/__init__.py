"""Run management on top of the store (extra ``runs``): the resume decision,
interruption accounting against a budget, ledger events, the operator record
and its timeline, the demo and the recovery drill.

Modules: :mod:`.decision`, :mod:`.budget`, :mod:`.events`, :mod:`.report`,
:mod:`.demo`, :mod:`.drill`.
"""
