"""The deletion guard of a restore onto a live root (holds_system, below), unless --force.

Before anything is written, what each layer deletes is read from its tar headers: whiteouts
(`.wh.NAME`) and opaque markers (`.wh..wh..opq`) at any depth, non-directories that would replace a
directory the root holds (the extractor removes that tree), and any member, a directory too, that
would replace a link to a directory holding anything (/bin -> usr/bin; the same link written again
is no deletion). A path counts as written again only where the extractor makes it (extract.creates:
no device node without --allow-devices, no never-write path), by the deleting layer or a later one:
on a skeleton's word only where the verdict does not hang on it (where, without that word, the
deletions would be the system's, those layers are streamed and their own headers counted: a skeleton
that claims a layer writes the system again cannot empty it). Files joined from part layers
(parts.py) and their other names must not land on a directory or a link to one. The headers come
from the snapshot's skeleton blob (snapshot/skeleton.py) where it has the layer's diff_id, without a
download; any other layer (a foreign one, a skeleton missing, malformed or too big) is streamed from
the registry, its digest and diff_id checked, its headers read and its contents dropped (nothing is
written: it downloads again to be applied). The manifest's `dev.snap.deletes` is never read: an
image can say anything there.

They are counted against the paths the root holds (box/deletions.py: count_live, and the rule for
when that is the system). Over it: exit 6, one line, the root untouched. Under it: each layer is
applied with the deletions that were counted, each with where it was counted to delete
(LayerJob.deletions), and the extractor refuses any other, or one that now lands elsewhere (a link
a layer put on the way): a layer whose bytes are not what its skeleton says cannot delete more than
was checked. Layers the root already holds (skip.py) are not applied, so delete nothing."""

from __future__ import annotations

import dataclasses
import os
import tarfile
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from snapshotter.box.deletions import Deleting, Deletions, LiveRoot, count_live, refuse_live
from snapshotter.errors import IntegrityError, UsageError
from snapshotter.layer.extract_model import creates
from snapshotter.oci.image import Image, Layer
from snapshotter.profile import PathSet
from snapshotter.registry.remote import Remote
from snapshotter.snapshot.skeleton import Skeleton
from snapshotter.tar.reader import iter_members
from snapshotter.tar.rules import OPAQUE, WHITEOUT_PREFIX, check_name, whiteout_target

from .parts import refuse_join_over_dir
from .rebuild import members_of
from .verify import read_blob

# {layer digest: {member path: where it was counted to delete}}: what each layer may delete.
Claims = dict[str, dict[str, Optional[str]]]


@dataclass
class LayerDeletions:
    """What a layer's headers delete, and what they write."""
    deleting: list[Deleting] = field(default_factory=list)  # its whiteouts and opaque markers
    # its members: they replace what is there
    writing: list[tuple[Deleting, tarfile.TarInfo]] = field(default_factory=list)
    created: set[str] = field(default_factory=set)  # the paths the extractor makes for it (extract.creates)


def read_deletions(members: Iterable[tarfile.TarInfo], allow_devices: bool = False) -> LayerDeletions:
    """The deletions of a layer's members, in the extractor's terms (layer/extract.py)."""
    out = LayerDeletions()
    for m in members:
        rel = check_name(m.name)
        if not rel:
            continue
        parent, _, base = rel.rpartition("/")
        if base == OPAQUE:
            out.deleting.append(Deleting(rel, parent, ""))
        elif base.startswith(WHITEOUT_PREFIX):
            out.deleting.append(Deleting(rel, parent, whiteout_target(base)))
        else:
            out.writing.append((Deleting(rel, parent, base), m))
            if creates(m, allow_devices) and not (m.islnk() and check_name(m.linkname) not in out.created):
                out.created.add(rel)  # a hardlink to a file not written before it is refused, not made
    return out


def guard_live_root(remote: Remote, image: Image, todo: list[Layer], skeletons: dict[str, Skeleton],
                    root: str, sign: str, never_write: PathSet, allow_devices: bool, joins: dict[str, list[str]],
                    log: Callable[[str], None]) -> Claims:
    """Refuse (IntegrityError) the layers `todo` when what they delete of the live `root` is its
    system, or when a file joined from part layers, or one of its names (`joins`: restore/parts.py),
    would replace a directory there; else what each may delete (Claims). Nothing is written to the
    root either way."""
    layers: dict[str, LayerDeletions] = {}
    said: set[str] = set()  # the layers read from their skeletons: their bytes are not checked yet
    for layer in todo:
        if layer.digest not in layers:
            layers[layer.digest], from_skeleton = _layer_deletions(
                remote, layer.descriptor, layer.diff_id, layer.label, skeletons.get(layer.diff_id), allow_devices, log)
            if from_skeleton:
                said.add(layer.digest)
    live = LiveRoot(root, never_write.match)
    replacing = {digest: _replacing(live, ld.writing) for digest, ld in layers.items()}
    counted, where = _count(live, todo, layers, replacing, said=set())
    # A deleted path a later layer writes again is not counted, but a skeleton's word that it does is
    # not taken where the deletions would be the system's without it: those layers' own headers are.
    # Again until no such word is left: a layer streamed may show deletions its skeleton hid.
    while not counted.deletes_system:
        targets = {t for t in where.values() if t is not None}
        crediting = [layer for layer in todo if layer.digest in said
                     and _writes_into(layers[layer.digest].created, targets)]
        if not crediting or not _count(live, todo, layers, replacing, said)[0].deletes_system:
            break
        for layer in crediting:
            if layer.digest in said:  # each streamed once: the loop ends
                said.discard(layer.digest)
                layers[layer.digest], _ = _layer_deletions(remote, layer.descriptor, layer.diff_id, layer.label,
                                                           None, allow_devices, log)
                replacing[layer.digest] = _replacing(live, layers[layer.digest].writing)
        counted, where = _count(live, todo, layers, replacing, said=set())
    refuse_live(root, str(image.ref), sign, counted)
    _refuse_joins_over_dirs(live, joins, set(where.values()))
    return {digest: {d.member: where[d.member] for d in (*ld.deleting, *replacing[digest])}
            for digest, ld in layers.items()}


def _writes_into(created: set[str], deleted: set[str]) -> bool:
    """Whether a path of `created` is one of the `deleted` targets or below one ("": the root's)."""
    if not (created and deleted):
        return False
    if "" in deleted:
        return True
    for rel in created:  # each path's own ancestors: the deleted targets may be many
        parts = rel.split("/")
        if any("/".join(parts[:k]) in deleted for k in range(1, len(parts) + 1)):
            return True
    return False


def _count(live: LiveRoot, todo: list[Layer], layers: dict[str, LayerDeletions],
           replacing: dict[str, list[Deleting]], said: set[str]) -> tuple[Deletions, dict[str, Optional[str]]]:
    """count_live of the layers' deletions, in order (a layer deletes what those before it wrote),
    with the paths each writes again, but those of the layers in `said`."""
    deleting, written = [], {}
    for n, layer in enumerate(todo):
        ld = layers[layer.digest]
        deleting += [dataclasses.replace(d, layer=n) for d in (*ld.deleting, *replacing[layer.digest])]
        if layer.digest not in said:
            written.update((rel, n) for rel in ld.created if not live.never(rel))
    return count_live(live, deleting, written)


def _refuse_joins_over_dirs(live: LiveRoot, joins: dict[str, list[str]], deleted: set[Optional[str]]) -> None:
    """A joined file or one of its names never replaces a directory, or a link to one (parts.py
    refuses it when joining): refused here too, before anything is written, unless a layer deletes
    what is there first."""
    for rel, names in joins.items():
        for name in (rel, *names):
            parent, _, base = name.rpartition("/")
            there = live.target(Deleting(name, parent, base))
            if there is None or any(there == d or there.startswith(f"{d}/") for d in deleted if d is not None):
                continue
            to = live.resolve(there)
            if to is not None and os.path.isdir(os.path.join(live.root, to)):
                refuse_join_over_dir(rel, name)


def _layer_deletions(remote: Remote, desc: dict, diff_id: str, label: str, skeleton: Optional[Skeleton],
                     allow_devices: bool, log: Callable[[str], None]) -> tuple[LayerDeletions, bool]:
    """From the skeleton when there is one that reads; else from the layer, streamed and checked.
    And whether they came from the skeleton."""
    if skeleton is not None:
        try:
            return read_deletions(members_of(skeleton, label), allow_devices), True
        except IntegrityError as e:
            log(f"warning: {e}: reading the layer's own headers")
    got: list[LayerDeletions] = []

    def consume(stream, check) -> None:
        got.append(read_deletions((m for _, m in iter_members(stream, f"layer {label}")), allow_devices))

    read_blob(remote, desc, diff_id, label, log, consume)
    return got[0], False


def _replacing(live: LiveRoot, writing: list[tuple[Deleting, tarfile.TarInfo]]) -> list[Deleting]:
    """The members that delete what they land on: a non-directory where the root holds a directory,
    any member (a directory too) where it holds a link to a directory that holds anything, but the
    same link (each directory read once)."""
    # parent as named -> {name: None for a directory, a link's target}
    entries: dict[str, dict[str, Optional[str]]] = {}
    out = []
    for d, m in writing:
        if d.parent not in entries:
            there = live.resolve(d.parent)
            entries[d.parent] = _replaceable(live, there) if there is not None else {}
        if d.name not in entries[d.parent]:
            continue
        link = entries[d.parent][d.name]
        if (link is None and not m.isdir()) or (link is not None and not (m.issym() and m.linkname == link)):
            out.append(d)
    return out


def _replaceable(live: LiveRoot, there: str) -> dict[str, Optional[str]]:
    """In directory `there`: {name: None} for its directories, {name: target} for its links to a
    directory that holds anything."""
    out: dict[str, Optional[str]] = {}
    try:
        with os.scandir(os.path.join(live.root, there)) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    out[e.name] = None
                elif e.is_symlink():
                    rel = f"{there}/{e.name}".strip("/")
                    to = live.resolve(rel)
                    if to is not None and to != rel and live.children(to):
                        out[e.name] = os.readlink(e.path)
    except OSError:
        pass
    return out


def holds_system(root: str) -> Optional[str]:
    """What shows that `root` holds an operating system (an os-release, a populated usr/), or None."""
    for rel in ("etc/os-release", "usr/lib/os-release"):
        if os.path.lexists(os.path.join(root, rel)):
            return rel
    try:
        if os.listdir(os.path.join(root, "usr")):
            return "a populated usr/"
    except OSError:
        pass
    return None


def refuse_live_system(root: str, image: Image, base_layers: int) -> None:
    """A full image applied onto a running system replaces its libc, /etc/passwd and /bin and applies
    the base's whiteouts: refused, before anything is written."""
    sign = holds_system(root)
    if sign:
        raise UsageError(
            f"{root!r} already holds an operating system ({sign}): restoring all of {image.ref}, "
            f"{base_layers} base layer(s) included, would overwrite its system files",
            "pass --only-snapshot if it runs the snapshot's base image, or restore into an empty directory "
            "(or start the image with `snap run` on a Docker host), or pass --force to overwrite it")
