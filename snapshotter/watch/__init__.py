"""`snap watch`: the watcher loop, its daemon, and providers' reclaim notices."""
