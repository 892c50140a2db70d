"""File indexes: the entry model, an image's index built from its layers, the index's on-disk
form, and the base index that travels with a snapshot."""
