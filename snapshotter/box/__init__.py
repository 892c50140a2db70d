"""The live box: its layer profile, the walk of its tree, its diff against the base image, the
mounts it sees, the files being written, and what deletions mean."""
