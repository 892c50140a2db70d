"""Talking to an OCI registry: the HTTP transport (auth, retries, error answers), the
protocol's verbs (Remote), blob uploads, and where a blob can be read from."""
