"""The ``tokenmill`` command line."""
