"""`snap restore` and `snap verify`: download, verify and apply an image's layers."""

from snapshotter.restore.restore import RestoreOptions, RestoreResult, restore_image

__all__ = ["RestoreOptions", "RestoreResult", "restore_image"]
