"""Reliability beyond the test suite: the soak (``python -m tests.reliability.soak``),
long runs of SIGKILLed writers judged from a fresh client after every kill."""
