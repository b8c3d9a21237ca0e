"""The analyses of a traced step's per-replica jaxpr: found at trace time, free at run time.

Modules:
    ``jaxpr_walk``: the one forward walk over a jaxpr that the analyses share.
    ``replication``: which outputs are the same on every replica (Mirrored) and which vary.
    ``rows``: which results hold a padded batch's rows.
    ``padding_check``: padded rows reaching a collective or a result: a warning.
    ``masked_stats``: flax's masked statistics averaged per replica: a warning.
    ``divergence``: mirrored inputs coming out different: a warning, and ``check_replicas``.
"""
