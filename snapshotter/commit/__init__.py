"""`snap commit`: scan, plan, push; from a box, a container, and the history of a tag."""

from .commit import commit_box
from .model import CommitOptions, CommitResult

__all__ = ["CommitOptions", "CommitResult", "commit_box"]
