"""Layers and trees: the plan that splits a diff into layers, the generator that writes a plan as
a tar, the extractor that writes a tar back as files, and the staging of split layers."""
