"""The concrete strategies: each is a ``Strategy`` over its own devices."""
