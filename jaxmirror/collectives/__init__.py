"""Cross-device operations: TF's ``CrossDeviceOps`` family."""
