"""Strategies: ``Strategy`` and ``StrategyExtended``, and one module per concrete strategy.

Strategies differ only in their devices and the placement of their variables; everything
else (``run``, ``reduce``, the input methods) is shared.
"""
