# Makes test modules here `integration_tests.test_*`, so their names never
# clash with same-named unit tests under tests/ when both run in one session.
