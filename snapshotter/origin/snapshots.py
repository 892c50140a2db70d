"""References in a snapshot (docs/weights-from-origin.md): what commit and restore do with them.

At commit (`--weights-from-origin`, or SNAP_WEIGHTS_FROM_ORIGIN=1): the box's hub caches are
recognised (hubcache.recognise), the referenced blobs and the box's token files are taken out of the
scan and the diff (so no layer holds them), and the References document is pushed as a side blob
(index/base.py's push_artifact, as the base index and the headers blobs: an artifact manifest lists
it, so a registry's garbage collection keeps it) that the snapshot's manifest names by digest in the
annotation SNAP_REFERENCES: the manifest digest covers it, and no engine is asked to apply it.

At restore: the document is read back by that digest (size-capped, checked as strictly as a layer)
and its blobs fetched from the restoring side's origin (fetch.fetch_all) while the layers apply."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
from typing import Callable, Optional

from snapshotter import jsontext
from snapshotter.box.diff import Diff
from snapshotter.box.scan import Scan
from snapshotter.errors import EngineUnavailable, IntegrityError, SnapError, UsageError
from snapshotter.index.base import push_artifact
from snapshotter.oci.image import Image
from snapshotter.profile import Profile
from snapshotter.registry.blobsources import BlobSources
from snapshotter.registry.remote import Remote
from snapshotter.registry.transport import TransportOptions
from snapshotter.state import sub

from .fetch import ENDPOINT_ENV, FetchReport, Origin, fetch_all
from .hubcache import Recognition, default_candidates, recognise, token_files
from .layout import complete_layout
from .references import DEFAULT_ENDPOINT, MEDIA_TYPE, References

SNAP_REFERENCES = "dev.snap.origin-references"  # manifest annotation: {"digest", "size", "files", "bytes"}
SNAP_ORIGIN_UPLOADED = "dev.snap.origin-uploaded"  # manifest annotation: hub files held as layers (--upload-origin)
ARTIFACT_TYPE = "application/vnd.boxsnap.origin.references.v1"
SETTING = "SNAP_WEIGHTS_FROM_ORIGIN"
MAX_DOCUMENT = 64 << 20  # 100k references are ~40 MB of JSON: anything bigger is refused
FETCHES = 4  # blobs fetched from the origin at once


def wanted(flag: bool) -> bool:
    """--weights-from-origin, else SNAP_WEIGHTS_FROM_ORIGIN (1/true/yes, 0/false/no or unset)."""
    text = os.environ.get(SETTING, "").strip().lower()
    if text not in ("", "0", "1", "true", "false", "yes", "no"):
        raise UsageError(f"{SETTING}={text[:50]!r} is not 1 or 0", "set it to 1 to keep hub weights as references")
    return flag or text in ("1", "true", "yes")


# What this process hashed of each root's blobs (hubcache.recognise's memo): a watcher's snapshots
# every few minutes, and its final one within a few seconds' grace, do not hash 40 GB again.
_HASHED: dict[str, dict] = {}


def recognise_box(root: str, leaves_out: Callable[[str], bool]) -> Recognition:
    """The references a commit of `root` keeps: its hub caches (each home's, and HF_HOME's and
    HF_HUB_CACHE's if set), recorded with the HF_ENDPOINT the box uses; none the profile leaves out
    (`leaves_out`: Profile.leaves_out), which the commit does not capture at all."""
    endpoint = os.environ.get(ENDPOINT_ENV, "").strip().rstrip("/") or DEFAULT_ENDPOINT
    return recognise(root, default_candidates(root, dict(os.environ)), endpoint=endpoint,
                     token_path=os.environ.get("HF_TOKEN_PATH"), memo=_HASHED.setdefault(root, {}),
                     leaves_out=leaves_out)


def box_tokens(root: str) -> Recognition:
    """The box's Hugging Face token files alone (each home's, HF_HOME's, HF_TOKEN_PATH): secrets a
    commit leaves out with or without --weights-from-origin (a custom HF_HOME's are out of the
    default profile's secret rules' sight)."""
    return Recognition(secrets=token_files(root, default_candidates(root, dict(os.environ)),
                                           os.environ.get("HF_TOKEN_PATH")))


def leave_out(scan: Scan, diff: Diff, found: Recognition, references: bool = True) -> tuple[Scan, Diff, dict]:
    """The scan and diff without the referenced blobs (`references`) and with the token files as
    left-out secrets: neither is in any layer. A copy: a watcher keeps its own scan for the next.
    Also the entries taken out ({path: Entry}): a watcher's box still holds them, unchanged."""
    gone = set(found.secrets) | ({r.blob_path for r in found.references} if references else set())
    if not gone:
        return scan, diff, {}
    secrets = sorted(set(scan.skipped_secrets) | {p for p in found.secrets if p in scan.entries})
    kept = dataclasses.replace(scan, entries={p: e for p, e in scan.entries.items() if p not in gone},
                               skipped_secrets=secrets, kept_as=None)
    taken = {p: scan.entries[p] for p in gone if p in scan.entries}
    changed = [e for e in diff.changed if e.path not in gone]
    return kept, Diff(changed, [p for p in diff.deleted if p not in gone]), taken


def push_document(remote: Remote, doc: References, sources: BlobSources) -> tuple[str, str]:
    """Push the document into `remote`'s repository as a side blob, kept by an artifact manifest of
    its own. Returns (its digest, the manifest annotation's value)."""
    data = doc.to_json()
    desc = doc.descriptor()
    tag = "snap-references-" + desc["digest"].replace(":", "-")
    push_artifact(remote, [(data, desc["digest"])], MEDIA_TYPE, ARTIFACT_TYPE, tag, {}, sources, "references")
    note = {"digest": desc["digest"], "size": desc["size"], "files": len(doc.references),
            "bytes": sum(r.size for r in {r.sha256: r for r in doc.references}.values())}
    return desc["digest"], json.dumps(note, sort_keys=True, separators=(",", ":"))


def noted(annotations: dict) -> Optional[dict]:
    """The SNAP_REFERENCES annotation read back ({"digest", "size", "files", "bytes"}); None if the
    snapshot has none. IntegrityError for one of another form (a hostile manifest)."""
    text = annotations.get(SNAP_REFERENCES)
    if text is None:
        return None
    try:
        note = jsontext.loads(text)
    except (ValueError, TypeError):
        note = None
    ok = isinstance(note, dict) and isinstance(note.get("digest"), str) and note["digest"].startswith("sha256:") \
        and all(type(note.get(k)) is int and note[k] >= 0 for k in ("size", "files", "bytes"))
    if not ok or note["size"] > MAX_DOCUMENT:
        raise IntegrityError(f"the snapshot's {SNAP_REFERENCES} annotation is malformed: refusing a hostile image")
    return note


def read_document(remote: Remote, annotations: dict) -> Optional[References]:
    """The snapshot's references, digest-checked, size-capped and checked as strictly as a layer;
    None for a snapshot without."""
    note = noted(annotations)
    if note is None:
        return None
    data = b"".join(remote.iter_blob(note["digest"], None, note["size"]))
    if len(data) != note["size"]:
        raise IntegrityError(f"the snapshot's list of weights from the origin is {len(data)} bytes, "
                             f"not the {note['size']} its manifest says")
    return References.from_json(data)


def fetch_into(root: str, doc: References, log: Callable[[str], None], workers: int = FETCHES,
               on_thread: Callable[[], None] = lambda: None) -> FetchReport:
    """Fetch every referenced blob into `root` from the origin this side names (HF_ENDPOINT, HF_TOKEN);
    `on_thread` as fetch_all's."""
    source = Origin.from_env()
    blobs = {r.blob_path: r.size for r in doc.references}
    log(f"fetching {len(blobs)} file(s) of weights from the origin {source.endpoint!r}")
    return fetch_all(root, list(doc.references), source, workers, on_thread=on_thread)


class BackgroundFetch:
    """fetch_into in a thread of its own, started before the layers apply: the weights arrive from
    the origin while the registry's layers do, and `--then`'s app does not wait for them. Each
    fetching thread calls `on_thread` first (the restore's priority for weights)."""

    def __init__(self, root: str, doc: References, log: Callable[[str], None], on_thread: Callable[[], None]):
        self.root, self.doc = root, doc
        self.report: Optional[FetchReport] = None
        self.error: Optional[BaseException] = None
        self.files = len({r.blob_path for r in doc.references})
        self.bytes = sum({r.blob_path: r.size for r in doc.references}.values())
        self._thread = threading.Thread(target=self._run, args=(root, doc, log, on_thread), name="origin-fetch",
                                        daemon=True)
        self._thread.start()

    def _run(self, root: str, doc: References, log: Callable[[str], None], on_thread: Callable[[], None]) -> None:
        try:
            self.report = fetch_into(root, doc, log, on_thread=on_thread)
        except BaseException as e:  # noqa: BLE001 - handed to finish(), in the restore's thread
            self.error = e

    def finish(self) -> FetchReport:
        """Once the layers are in: wait for the fetch, make any snapshot symlink or ref the layers did
        not bring (layout.complete_layout: not before, or it would race the layer that has them), and
        raise the first failure as its own kind (every other blob was tried)."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        complete_layout(self.root, self.doc)
        self.report.raise_first()
        return self.report


def start_fetch(root: str, remote: Remote, annotations: dict, log: Callable[[str], None],
                profile: Optional[Profile] = None, on_thread: Callable[[], None] = lambda: None
                ) -> Optional[BackgroundFetch]:
    """The snapshot's references fetched in the background (None for a snapshot without); a snapshot
    whose hub files the layers hold (--upload-origin) is said so in one line. A blob, symlink or ref
    at a path the restore `profile` excludes (never written) is neither fetched nor made. Each
    fetching thread calls `on_thread` before each blob."""
    uploaded = annotations.get(SNAP_ORIGIN_UPLOADED, "")
    if uploaded.isdigit():
        log(f"weights from the origin: {int(uploaded)} hub file(s) come from the registry's copy "
            "(uploaded with --upload-origin), not the origin")
    doc = read_document(remote, annotations)
    if doc is not None and profile is not None:
        excluded = profile.exclude.match
        doc = References(tuple(r for r in doc.references if not (excluded(r.blob_path) or excluded(r.link_path))),
                         tuple(r for r in doc.refs if not excluded(r.file_path)))
    if doc is None or not doc.references:
        return None
    Origin.from_env()  # a bad HF_ENDPOINT is a usage error before anything is written
    return BackgroundFetch(root, doc, log, on_thread)


def run_mounts(image: Image, transport: TransportOptions, log: Callable[[str], None],
               engine_elsewhere: Callable[[], Optional[str]] = lambda: None) -> list[str]:
    """`snap run` hands the image to an engine, which cannot fetch references: fetch them onto this
    host (the state dir, by manifest digest: a second run fetches nothing) and give each blob as a
    read-only bind mount at its path ("HOST:PATH:ro"), under the symlinks the layers hold. `image` is
    the manifest snap read (engine/run.py), which the engine pulls by that digest: the weights
    mounted are its own, wherever a watcher moves the tag. No mounts for a snapshot without references.
    Refused, before anything is fetched, for an engine on another machine (`engine_elsewhere()`: its
    host, asked only here): the bind mounts would name that machine's paths, the weights be empty folders."""
    note = noted(image.annotations)
    if not note or not note["files"]:
        return []
    elsewhere = engine_elsewhere()
    if elsewhere is not None:
        raise EngineUnavailable(
            f"this snapshot's weights ({note['files']} hub file(s) from the origin) are bind-mounted from this "
            f"machine's disk, and the engine runs on another machine ({elsewhere!r}, this one is "
            f"{socket.gethostname()!r}): the container would find empty folders where they belong",
            "run snap on the engine's machine, or `snap restore` the box there; a snapshot committed with "
            "`snap commit --upload-origin` carries its weights in its layers")
    host = sub("origin-run", image.manifest_digest.split(":", 1)[1])
    doc = read_document(Remote(image.ref, transport), image.annotations)
    try:
        fetch_into(host, doc, log).raise_first()
    except SnapError as e:
        raise type(e)(str(e.args[0]), "or commit it with `snap commit --upload-origin`, which makes it "
                      "self-contained") from None
    log(f"weights from the origin: {len(doc.references)} hub file(s) bind-mounted read-only from {host!r}")
    return [f"{os.path.join(host, path)}:/{path}:ro" for path in sorted({r.blob_path for r in doc.references})]
