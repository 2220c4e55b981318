"""The ``tokenloom`` command line."""
