"""Job specs used by the tests: `broken/` holds specs that must fail with a given field path and message."""
