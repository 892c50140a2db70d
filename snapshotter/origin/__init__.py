"""Weights from the origin (issue 36): hub-cache blobs that Hugging Face serves, kept in a snapshot
as references (which file of which repository at which commit, and its sha256) instead of bytes, and
fetched back from the origin at restore. references: the model and its one serialised form;
hubcache: recognising them in a box's hub caches; fetch: bringing them back, verified; layout: the
symlinks and refs that make the blobs a hub cache again."""
