"""`snap commit`: scan, plan, push; from a box, a container, and the history of a tag."""

from snapshotter.commit.commit import CommitOptions, CommitResult, commit_box

__all__ = ["CommitOptions", "CommitResult", "commit_box"]
