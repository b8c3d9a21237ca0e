"""Variables: ``Variable``, ``MirroredVariable``/``SyncOnReadVariable``, and their checkpoints.

Built on ``core`` only. ``variable`` owns a variable's state: the rest of jaxmirror reads it with
``variable.state_of`` and writes it with ``variable.write_back``.
"""
