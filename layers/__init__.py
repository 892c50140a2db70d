"""The YAML layer profiles, shipped inside the snapshotter package as snapshotter.layers."""
