# snap itself as an image, for providers that only take images: run `snap restore` as an init step
# that writes the box into a volume the main container then uses, e.g.
#   docker run --rm -v /mnt/box:/box IMAGE restore registry.example.com/me/box:v2 --root /box
FROM python:3.11-slim
COPY pyproject.toml README.md /src/
COPY snapshotter/ /src/snapshotter/
COPY layers/ /src/layers/
# All dependencies have wheels: no compiler needed, nothing left behind but the installed package.
RUN pip install --no-cache-dir /src && rm -rf /src
ENTRYPOINT ["snap"]
CMD ["--help"]
