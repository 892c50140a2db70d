"""Talking to an OCI registry. Bottom up: what its answers say (answers), when to ask again
(retry), who we are (Docker's config file and its credential helpers: docker_config,
credential_helper; then credentials, auth), where it listens (ping); the HTTP transport composing
them (transport); blob uploads over a transport (upload); the protocol's verbs for one repository
(Remote, remote); and which repositories are known to hold a blob (blobsources)."""
