"""The checks of a certify run, one concept per module."""
