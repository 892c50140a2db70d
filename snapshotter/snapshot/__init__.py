"""What a root remembers of its snapshots, shared by commit and restore: the stat cache, the
restore record, layer skeletons, the lineage rule (the tag moves only forward), and which layers
of the last snapshot hold each file."""
