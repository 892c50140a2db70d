"""The Docker Engine: `snap run`, and the connection a container commit uses."""
