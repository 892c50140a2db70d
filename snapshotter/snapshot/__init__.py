"""What a root remembers of its snapshots, shared by commit and restore: the stat cache, the
restore record, layer skeletons, and the lineage rule (the tag moves only forward)."""
