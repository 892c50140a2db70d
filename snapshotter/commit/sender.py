"""One planned layer built (or measured) and sent: a compressed one built into the state dir, in this
process or a packer process, then uploaded unless the registry has it; one stored as is (weights)
measured, then streamed from the box again as it is sent; encrypted, to ocicrypt, in one pass where
its key is random (snapshot/encryption.py's upload_sealing), else counted first. A compressed layer
the state dir's disk has no room for is measured and sent as a stored one is (compressed twice):
a box whose disk filled up is the one to snapshot before it is lost."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Optional

from snapshotter.errors import DiskFull, IntegrityError
from snapshotter.jobs import cpu_count
from snapshotter.layer.generate import LayerBlob, build_layer, measure_layer, survey_layer, write_layer
from snapshotter.layer.packers import Packers, PackJob
from snapshotter.layer.plan import LayerPlan
from snapshotter.registry.blobsources import in_registry
from snapshotter.registry.remote import Remote, copy_file
from snapshotter.registry.upload import DigestFirst
from snapshotter.snapshot import skeleton
from snapshotter.snapshot.encryption import SealingWriter
from snapshotter.state import BUILT_LAYERS, holding, sub

from .model import CommitPlan

UPLOADS = 3  # layers uploaded at once (memory: a few MiB each), while the next ones are packed
NOT_SENT_TORN = "not sent: a file changed while read or since the scan"


class LayerSender:
    """Builds one planned layer (in this process, or a packer process) and sends it, at most
    cp.jobs layers packed and UPLOADS sent at once."""

    def __init__(self, cp: CommitPlan, remote: Remote, packers: Optional[Packers], count: int, on_pack, on_up):
        self.root, self.zstd_level, self.sources, self.remote = cp.root, cp.zstd_level, cp.sources, remote
        self.packers, self.on_pack, self.on_up = packers, on_pack, on_up
        self.encryption = cp.encryption
        self.log = cp.log
        self.after_read = cp.hooks.after_read  # into every read of a box file, here and in the packers
        self.out_dir = sub(BUILT_LAYERS)
        # A packer's zstd gets its share of the cores; one layer in this process gets them all. Either
        # way the frames are the same (tar/compress.py).
        self.zstd_threads = max(1, cpu_count() // count) if count else -1
        self.slots = threading.Semaphore(cp.jobs)  # layers packed at once
        self.sending = threading.Semaphore(UPLOADS)

    def produce(self, plan: LayerPlan) -> tuple[LayerBlob, str]:
        one_pass = True  # an encrypted layer's upload may go in one pass (until one failed: DigestFirst)
        if self._reads_once(plan):
            try:
                with self.sending:
                    if (done := self._read_once(plan)) is not None:
                        return done
            except DigestFirst:
                one_pass = False
        with self.slots:
            blob, piece = self._pack_or_measure(plan)
        # A built blob is held from now until it is sent and removed: a sweep by another snap process
        # leaves it, however long it waits for an upload slot (state.holding).
        with holding(blob.path) if blob.path else contextlib.nullcontext():
            skeleton.keep(blob.diff_id, piece)
            with self.sending:
                return self._send(plan, blob, one_pass)

    def _send(self, plan: LayerPlan, blob: LayerBlob, one_pass: bool = True) -> tuple[LayerBlob, str]:
        if self.encryption is not None:
            return blob, (self._send_encrypted(blob) if blob.path
                          else self._upload_measured_encrypted(plan, blob, one_pass))
        if plan.compression == "none":
            if blob.not_whole:
                return blob, NOT_SENT_TORN
            if there := in_registry(self.remote, blob.digest, self.sources):
                return blob, there
            return blob, self._upload_measured(plan, blob)
        if blob.not_whole:  # the built blob is removed once sent, or not sent (produce)
            return blob, NOT_SENT_TORN
        if there := in_registry(self.remote, blob.digest, self.sources):
            return blob, there
        if blob.path is None:  # measured: no room to build it (produce)
            return blob, self._upload_measured(plan, blob)
        self.remote.upload_blob(blob.path, blob.digest, blob.size, self.on_up, what="layers")
        return blob, "uploaded"

    def _send_encrypted(self, blob: LayerBlob) -> str:
        """Send the built blob encrypted: the encrypted blob already pushed for it (state dir, the
        tag's snapshot), else the file encrypted in place (a derived key's blob may be there already)."""
        if blob.not_whole:
            return NOT_SENT_TORN
        sealed = self.encryption.lookup(blob.digest, blob.diff_id, blob.media_type)
        if sealed and (there := in_registry(self.remote, sealed["digest"], self.sources)):
            return there
        if self.encryption.secret is None:
            try:
                self._seal_and_send(blob, lambda out: copy_file(blob.path, out))
                return "uploaded"
            except DigestFirst:
                pass  # encrypted in place and counted first, as a derived key's: it can resume
        sealed = self.encryption.encrypt_in_place(blob.path, blob.digest, blob.diff_id, blob.media_type)
        if there := in_registry(self.remote, sealed["digest"], self.sources):
            return there
        self.remote.upload_blob(blob.path, sealed["digest"], sealed["size"], self.on_up, what="layers")
        return "uploaded"

    def _pack_or_measure(self, plan: LayerPlan) -> tuple[LayerBlob, bytes]:
        """_pack(), or where the state dir's disk has no room to build a compressed layer, _measure()
        (_send then compresses it again as it is sent). The packing bar counts on from the bytes the
        build counted, and a stop is seen while the layer is measured."""
        counted = 0

        def built(n: int) -> None:
            nonlocal counted
            counted += n
            self.on_pack(n)

        try:
            return self._pack(plan, built)
        except DiskFull:  # only a build writes to the state dir: a layer stored as is is measured already
            pass
        self.log(f"{plan.label}: no room to build it in {self.out_dir!r}: compressed as it is sent instead "
                 "(twice: measured first)")

        def measured(n: int) -> None:
            nonlocal counted
            again = min(n, counted)  # read by the build already
            counted -= again
            self.on_pack(n - again)  # 0 too: it raises Stopped once the commit stops

        return self._measure(plan, measured)

    def _pack(self, plan: LayerPlan, on_bytes) -> tuple[LayerBlob, bytes]:
        """The layer's blob and its skeleton's piece (its headers, as written)."""
        if plan.compression != "none" and self.packers is not None:
            return self.packers.pack(PackJob(plan, self.root, self.out_dir, self.zstd_level, self.zstd_threads,
                                             skeleton.PieceWriter, self.after_read), on_bytes)
        if plan.compression == "none":
            # Stored as is: hash it in one read (the hash lets other threads run), then stream it
            # again to the registry only if the registry lacks it. No copy of tens of GB on the
            # box's (often full) disk.
            return self._measure(plan, on_bytes)
        headers = skeleton.PieceWriter()
        blob = build_layer(self.root, plan, self.out_dir, self.zstd_level, on_bytes, headers,
                           after_read=self.after_read)
        return blob, headers.finish(blob.diff_id)

    def _measure(self, plan: LayerPlan, on_bytes=None) -> tuple[LayerBlob, bytes]:
        """The layer's digests and size, its bytes kept nowhere (_upload_measured streams it again)."""
        headers = skeleton.PieceWriter()
        blob = measure_layer(self.root, plan, self.zstd_level, on_bytes, headers, self.after_read)
        return blob, headers.finish(blob.diff_id)

    def _reads_once(self, plan: LayerPlan) -> bool:
        """A layer stored as is, encrypted under a random key: no blob of it can be in the registry,
        so it need not be measured first (_read_once)."""
        enc = self.encryption
        return (enc is not None and enc.secret is None and plan.compression == "none"
                and not self.remote.transport.chunks_refused)

    def _read_once(self, plan: LayerPlan) -> Optional[tuple[LayerBlob, str]]:
        """The layer surveyed (its files' headers and sizes, unread), then read once as it is encrypted
        and sent, its digest and diff_id learned on the way: the box's weights read once, not twice.
        Files that did not hold still while read: the layer is not sent (the caller holds them back).
        None: measured first after all (a blob of its size is known: it may be one). DigestFirst: the
        one pass failed, and cannot resume: the layer is measured, then counted first."""
        surveyed = survey_layer(self.root, plan)
        if surveyed.not_whole:
            return surveyed, NOT_SENT_TORN
        if self.encryption.may_hold(surveyed.size):
            return None
        headers, again = skeleton.PieceWriter(), []

        def write_plain(out) -> None:
            again[:] = [write_layer(out, self.root, plan, self.zstd_level, self.on_pack, as_seen=surveyed.seen,
                                    after_read=self.after_read, headers=headers)]

        def settled() -> bool:
            return bool(again) and not (again[0].not_whole or again[0].grown)

        try:
            plain, _ = self.encryption.upload_sealing(self.remote, write_plain, surveyed.media_type, surveyed.size,
                                                      self.on_up, settled=settled)
        except IntegrityError as e:
            return surveyed, held_back(surveyed, again[0] if again else None, e)
        skeleton.keep(plain, headers.finish(plain))
        return dataclasses.replace(surveyed, digest=plain, diff_id=plain), "uploaded"

    def _seal_and_send(self, blob: LayerBlob, write_plain) -> None:
        """Send the layer encrypted in one pass as `write_plain` writes its plain bytes (a random key: no
        blob of it can be in the registry already). DigestFirst: it goes up counted first, resumable."""
        self.encryption.upload_sealing(self.remote, write_plain, blob.media_type, blob.size, self.on_up,
                                       plain_digest=blob.digest, diff_id=blob.diff_id)

    def _upload_measured_encrypted(self, plan: LayerPlan, blob: LayerBlob, one_pass: bool = True) -> str:
        """A measured layer encrypted as it is read again: in one pass (_seal_and_send, unless one
        failed already), else twice under one key, once to learn the encrypted blob's digest (its plain
        bytes checked against the digest measured), once as it is sent. As a clear one, no copy of it
        on the box's disk."""
        if blob.not_whole:
            return NOT_SENT_TORN
        enc = self.encryption
        sealed = enc.lookup(blob.digest, blob.diff_id, blob.media_type)
        if sealed and (there := in_registry(self.remote, sealed["digest"], self.sources)):
            return there
        if enc.secret is None and one_pass:
            try:
                return self._upload_measured(plan, blob, lambda produce: self._seal_and_send(blob, produce))
            except DigestFirst:
                pass  # counted first, as a derived key's: it can resume
        key = enc.layer_key(blob.diff_id, blob.digest)
        counted = SealingWriter(None, key, record=True)  # each block's hash: the upload's read is checked
        again = write_layer(counted, self.root, plan, self.zstd_level, as_seen=blob.seen, after_read=self.after_read)
        if counted.plain_digest != blob.digest:
            return held_back(blob, again, IntegrityError(f"layer {plan.label!r} changed while it was encrypted"))
        sealed = enc.descriptor_of(counted, blob.digest, blob.diff_id, blob.media_type)
        if there := in_registry(self.remote, sealed["digest"], self.sources):
            return there
        return self._upload_measured(plan, blob, lambda produce: self.remote.upload_from(
            lambda out: produce(SealingWriter(out, key, expect=counted)), sealed["digest"], blob.size, self.on_up,
            what="layers"))

    def _upload_measured(self, plan: LayerPlan, blob: LayerBlob, send=None) -> str:
        """Send a measured layer (stored as is: read again from the box as it is sent), each file's
        header as measured and its bytes up to the size measured. A file that only grew since (a log, a
        download) gives the bytes measured: it is sent as first seen, and named in blob.grown. One whose
        bytes changed gives others, which the registry refuses: it is held back as torn (blob's
        changed_while_read; the caller builds the layer again without it). `send(produce)`: an
        encrypted layer's upload, `produce(out)` writing its plain bytes."""
        again: list[LayerBlob] = []

        def produce(out) -> None:
            again[:] = [write_layer(out, self.root, plan, self.zstd_level, as_seen=blob.seen,
                                    after_read=self.after_read)]

        try:
            if send:
                send(produce)
            else:
                self.remote.upload_from(produce, blob.digest, blob.size, self.on_up, what="layers")
        except IntegrityError as e:
            return held_back(blob, again[0] if again else None, e)
        blob.grown = again[0].grown if again else {}
        return "uploaded"


def held_back(blob: LayerBlob, again: Optional[LayerBlob], error: IntegrityError) -> str:
    """A layer whose bytes changed when read again (a measured one) or while read once: held back as
    torn if any file did not hold still (grew, became unreadable, went or was swapped: all of them
    named, the caller builds the layer again without them), else `error`."""
    if again is None or not (again.grown or again.not_whole):
        raise error
    blob.changed_while_read = sorted((set(again.grown) | set(again.changed_while_read)) - set(again.unreadable))
    blob.changed_since_scan = again.changed_since_scan
    blob.unreadable, blob.read_errors = again.unreadable, again.read_errors
    return NOT_SENT_TORN
