"""A box that may not move its tag (lineage.py) still saves its work: to a tag of its own in the same
repository, TAG-diverged-<UTC time of the divergence>, which it moves forward instead. Here: those
tags' names, this box's own among them, the listing `snap log` and `snap status` show, --keep's
pruning, and Line, which says where a box's next snapshot goes.

The rule (docs/watch.md): a snapshot goes to the moving tag while this box came from or made the
snapshot it names; else to the box's diverged tag (its own from before, if one names a snapshot
the box made since the last restore into it: a restarted watcher goes on in it; else a new one, so
a diverged tag only ever moves forward by one line of work). Before each diverged snapshot, and
before any snapshot after a restore into the root, the moving tag is looked at again:
once this box may move it (a `snap restore` of it finished here, or it was put on a snapshot this
box made: adopted), the snapshots go back to it. A restore into the root while diverged leaves the
diverged tag as it was and opens a new one: a half-restored box never replaces the work. A
diverged tag is never deleted by the box that moves it, only by --keep, as the oldest beyond N of
those the pruning box made (never another box's)."""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Iterable, Iterator, Optional

from snapshotter import jsontext
from snapshotter.oci.image import CREATED, manifest_annotations
from snapshotter.oci.mediatypes import OCI_MANIFEST
from snapshotter.oci.reference import Reference
from snapshotter.registry.remote import Remote
from snapshotter.registry.transport import TransportOptions

from .lineage import known_origins, made_here, movable
from .record import restore_mark
from .statcache import made_from

MARK = "-diverged-"
STAMP = "%Y%m%dT%H%M%SZ"
# Tags are at most 128 characters: the time (16) and a second one's -N (up to 4) must fit after TAG.
ROOM = 128 - len(MARK) - 16 - 4


def prefix(tag: str) -> str:
    """What every diverged tag of `tag` starts with: `tag-diverged-`; a tag too long for that is
    cut, with 8 hex digits of its hash, so that two long tags with one start keep theirs apart."""
    if len(tag) <= ROOM:
        return tag + MARK
    return f"{tag[:ROOM - 9]}-{hashlib.sha256(tag.encode()).hexdigest()[:8]}{MARK}"


def names(tag: str, tags: Iterable[str]) -> list[str]:
    """The diverged tags of `tag` among `tags`, oldest first."""
    pat = re.compile(re.escape(prefix(tag)) + r"(\d{8}T\d{6}Z)(?:-(\d+))?")
    found = [(m.group(1), int(m.group(2) or 1), t) for t in tags if (m := pat.fullmatch(t))]
    return [t for _, _, t in sorted(found)]


def new_name(tag: str, at: float, taken: Iterable[str]) -> str:
    """A new diverged tag of `tag`, at `at` (UTC), none of `taken`."""
    base = prefix(tag) + datetime.fromtimestamp(at, timezone.utc).strftime(STAMP)
    taken, name, n = set(taken), base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    return name


def _made(remote: Remote, tag: str, made: set[str], tags: list[str]) -> Iterator[tuple[str, str]]:
    """(tag, digest) of each diverged tag of `tag` that names one of the snapshots `made`, newest first."""
    for name in reversed(names(tag, tags)):
        digest = remote.manifest_digest(name)
        if digest in made:
            yield name, digest


def own(remote: Remote, tag: str, root: str, tags: list[str]) -> Optional[tuple[str, str]]:
    """(tag, digest) of the newest diverged tag of `tag` that names a snapshot `root` made since the
    last restore into it (lineage.made_here), if any: the one line of work a box goes on in. One a
    restore wrote over since (finished or not), or that a lost state dir no longer knows, is never
    moved again: it keeps the work from before."""
    return next(_made(remote, tag, set(made_here(root)), tags), None)


def own_names(remote: Remote, tag: str, root: str, tags: list[str]) -> list[str]:
    """The diverged tags of `tag` that name a snapshot `root` made, oldest first: the only ones its
    --keep prunes (another box's, however old, holds that box's work)."""
    return [name for name, _ in _made(remote, tag, set(made_from(root)), tags)][::-1]


@dataclass
class DivergedTag:
    tag: str
    digest: str
    created: str  # the snapshot's UTC time (RFC 3339, its manifest's annotation)
    own: bool  # the root asked about made it


def listing(remote: Remote, tag: str, root: Optional[str] = None) -> list[DivergedTag]:
    """The diverged tags of `tag` in `remote`'s repository, oldest first, with what each names."""
    made = set(made_from(root)) if root else set()
    found = []
    for name in names(tag, remote.list_tags()):
        digest = remote.manifest_digest(name)
        if digest is None:
            continue
        body, _, _ = remote.get_manifest(digest)
        try:
            doc = jsontext.loads(body)
        except ValueError:
            doc = None
        ann = manifest_annotations(doc, f"image {remote.ref.name}@{digest}") if isinstance(doc, dict) else {}
        found.append(DivergedTag(name, digest, ann.get(CREATED, ""), digest in made))
    return found


def prune(remote: Remote, series: list[list[str]], keep: int, also: list[str], log: Callable[[str], None]) -> bool:
    """--keep: of each series of tags (oldest first), delete the manifests of all but the newest
    `keep`, never one that a kept tag or a tag of `also` names. False: the registry allows no deletes."""
    drop = [t for tags in series for t in tags[:-keep]]
    if not drop:
        return True
    protected = {remote.manifest_digest(t) for t in [t for tags in series for t in tags[-keep:]] + also}
    for tag in drop:
        digest = remote.manifest_digest(tag)
        if digest is None or digest in protected:
            continue
        if not remote.delete_manifest(digest):
            return False
        log(f"deleted old snapshot {tag}")
    return True


class Line:
    """Where a box's snapshots go: the moving tag `main` while this box may move it, else its
    diverged tag. check() before a snapshot decides; move() puts a snapshot pushed under a tag of
    its own on the moving tag (or, if someone else moved that meanwhile, on a diverged tag)."""

    def __init__(self, main: Reference, transport: TransportOptions, root: str, force: bool = False,
                 origins: tuple[str, ...] = (), log: Callable[[str], None] = lambda m: None,
                 clock: Callable[[], float] = time.time):
        self.main, self.transport, self.root, self.force, self.origins = main, transport, root, force, origins
        self.log, self.clock = log, clock
        self._remote: Optional[Remote] = None
        self.checked = False
        self.diverged: Optional[str] = None  # the diverged tag, while the snapshots go there
        self.digest: Optional[str] = None  # what the target tag names, as this box last saw or moved it
        self.mark: tuple = ()  # the root's restore mark (record.py) at the last check
        # Why the box's snapshot may not go on the moving tag whatever its lineage (it deletes the
        # base's system: box/deletions.py), while that holds; the snapshot goes to the diverged tag.
        self.refused: Optional[str] = None

    @property
    def tag(self) -> str:
        """The tag the next snapshot goes to (or is put on)."""
        return self.diverged or self.main.tag

    def ref(self, tag: str) -> Reference:
        return Reference(self.main.registry, self.main.repository, tag)

    def remote(self) -> Remote:
        """The one connection to the moving tag's repository for this round of looks (the lineage
        check, the tag move, the comparison, the pruning), made at first use."""
        if self._remote is None:
            self._remote = Remote(self.main, self.transport)
        return self._remote

    def reconnect(self) -> None:
        """The next look makes a new connection: a ping again (a registry that answered wrong while
        it started), the credentials read again (rotated tokens, a new `snap login`), no socket left
        idle for the NAT to drop. A watcher calls it at each round."""
        self._remote = None

    def check(self) -> bool:
        """Decide the target tag (the rule above). True on the first check, whenever the target
        changed, and after a restore into the root since the last check: what its snapshot holds
        (self.digest) and which files a restore wrote are then to be read again."""
        remote = self.remote()
        mark = restore_mark(self.root)  # first: a restore after this look is seen at the next one
        changed = self._decide(remote, not self.checked, self.checked and mark != self.mark)
        # Kept only once decided: a look the registry failed leaves the restore to be seen at the next
        # one (else the box that a restore wrote into half-way would go on moving the tag).
        self.checked, self.mark = True, mark
        return changed

    def _decide(self, remote: Remote, first: bool, restored: bool) -> bool:
        current, ok = movable(remote, self.main, self.root, self.force, self.origins)
        if ok and self.refused is None:
            was, self.diverged, self.digest = self.diverged, None, current
            if was:
                self.log(f"{self.main} names {str(current)[:19]}, which {self.root!r} came from (a finished "
                         f"`snap restore`) or made, and its snapshot no longer deletes the base's system: moving it "
                         f"again; {self.main.name}:{was} keeps the work made before (docs/watch.md: adopt it)")
            return first or was is not None or restored
        if self.diverged is None:
            self._diverge(remote, f"{self.main} names {current[:19]}, a snapshot {self.root!r} neither came from "
                          "(no finished `snap restore` of it here) nor made" + (" since the last restore into it"
                                                                                 if restored else ""))
            return True
        if restored:
            self._diverge(remote, f"a restore into {self.root!r} ran since this box diverged: "
                          f"{self.main.name}:{self.diverged} keeps the work from before it")
            return True
        return False

    def restored(self) -> bool:
        """Whether a restore wrote into the root since the last check (a state-dir file read): the
        box may no longer be the one whose tag it moves, and check() is due before its next snapshot."""
        return restore_mark(self.root) != self.mark

    def _diverge(self, remote: Remote, why: str) -> None:
        """Send the snapshots to this box's diverged tag from now on: its own from before (own(): one
        that names a snapshot made since the last restore into the root), else a new one."""
        tags = remote.list_tags()
        found = own(remote, self.main.tag, self.root, tags)
        if found:
            (self.diverged, self.digest), how = found, "its own from before"
        else:
            self.diverged, self.digest, how = new_name(self.main.tag, self.clock(), tags), None, "a tag of its own"
        self.log(f"{why}: {self.main.tag} is not moved; this box's snapshots go to {self.main.name}:{self.diverged}, "
                 f"{how} (`snap log {self.main}` lists it; docs/watch.md says how to adopt it)")

    def refuse(self, why: str) -> bool:
        """The box's snapshot may not go on the moving tag (`why`: it deletes the base's system): it
        goes to the diverged tag, until allow(). True when the target tag changed."""
        self.refused = why
        if self.diverged is not None:
            return False
        self._diverge(self.remote(), why)
        return True

    def allow(self) -> bool:
        """The box's snapshot may go on the moving tag again, as far as what it deletes goes. True when it
        was refused: check() then says where the next snapshot goes."""
        was, self.refused = self.refused, None
        return was is not None

    def note(self) -> str:
        """What a line about a snapshot adds while diverged: why the moving tag is not moved."""
        if self.refused:
            return f"{self.main.tag} not moved ({self.refused}; such a snapshot goes on it only with --force)"
        return f"{self.main.tag} not moved (it names a snapshot this box neither came from nor made)"

    def move(self, digest: str) -> None:
        """Put the target tag on the snapshot `digest`, pushed under a tag of its own. The moving
        tag, unless someone else moved it since this box last did (another box racing for it):
        then the snapshot goes to a diverged tag, and so do the next ones."""
        remote = self.remote()
        if self.diverged is None:
            now = remote.manifest_digest(self.main.tag)
            if (now not in (self.digest, digest) and not self.force
                    and now not in known_origins(self.root, self.origins)):  # e.g. a `snap commit` of this box
                self._diverge(remote, f"{self.main} was moved to {str(now)[:19]} by someone else while this box "
                              f"kept it (it named {str(self.digest)[:19]})")
        body, _, _ = remote.get_manifest(digest)
        remote.put_manifest(body, OCI_MANIFEST, self.tag)
        self.digest = digest
