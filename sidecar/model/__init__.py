"""Pure values and rules: no I/O is imported below this package."""
