"""What the tests, the demo and the bench share, one module per kind of helper:

run          snap's command line (and its peak memory), processes, ports, what a run makes once, pip from
             .ci/wheels, one-line errors
registry     docker-registry on 127.0.0.1 (plain, htpasswd, TLS, S3, token auth) and what tests read of it
credentials  Docker's config and real credential helper programs
servers      what the test's own HTTP servers share (a thread, a handler, an answer in pieces)
faults       servers that misbehave: a fault proxy, a lying server, a cloud's metadata service
engine       a real dockerd, and the Engine API of a chosen version
tars         tars built by hand, headers tarfile will not write
images       images pushed by hand and snap's images read back
schema       the OCI image-spec's JSON schemas
trees        the base rootfs, boxes, the one tree fingerprint, the jail
watch        the watcher, in this process or as `snap watch`
packers      hooks run in packer processes
hub          a loopback Hugging Face hub and its CDN, as huggingface_hub's client meets them

The fixtures are in conftest.py."""
