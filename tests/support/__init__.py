"""Test harnesses shared by several test files (and by benchmarks that run the same checks):
importable as `support.<module>` because pytest puts tests/ on sys.path; benchmarks add it."""
