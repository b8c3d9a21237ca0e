"""Cross-device operations: TF's ``CrossDeviceOps`` family, and the collectives they run.

Modules:
    ``cross_device_ops``: ``CrossDeviceOps`` and its family: how a strategy sums values.
    ``algorithms``: the collectives: all-reduce, hierarchical, to one device.
    ``packing``: a nest's leaves as a few flat buffers, one collective each.
    ``communication``: ``CommunicationOptions`` and ``CommunicationImplementation``.
"""
