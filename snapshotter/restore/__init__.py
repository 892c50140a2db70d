"""`snap restore` and `snap verify`: download, verify and apply an image's layers."""

from .restore import RestoreOptions, RestoreResult, restore_image

__all__ = ["RestoreOptions", "RestoreResult", "restore_image"]
