"""What the commands print: one escaped line at a time on stderr (what happens) or stdout (the result),
and each command's result as lines or as JSON."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import typer

from snapshotter.errors import printable
from snapshotter.progress import human_size


def say(msg: str) -> None:
    """One line on stderr. Messages carry what registries, images, a box's file names and the engine
    said: control characters are escaped here, so none can forge a line or drive the terminal."""
    typer.echo(printable(msg), err=True)


def out(msg: str) -> None:
    """One line on stdout, escaped as say's."""
    stdout(printable(msg))


def stdout(text: str) -> None:
    """`text` and a newline on stdout (JSON as json.dumps escaped it). Once stdout's reader has gone
    (`snap log | head -1`) the rest is dropped, quietly: the command ends as it would have, with
    its own exit code (verify's 9 stays 9)."""
    try:
        typer.echo(text)
    except BrokenPipeError:
        drop_stdout()


def drop_stdout() -> None:
    """Point stdout's fd at /dev/null, once writing to it failed: what its buffer still holds goes
    there, at exit too, instead of raising again ("Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def as_json(doc) -> None:
    stdout(json.dumps(doc, indent=2))


def utc(created: str) -> str:
    return created.replace("T", " ").replace("Z", " UTC")


def with_ref(result) -> dict:
    """A result as JSON takes it: its reference as a string."""
    doc = asdict(result)
    doc["ref"] = str(result.ref)
    return doc


def commit_left_out(result) -> None:
    """What the commit did not capture, and why: secrets, unreadable paths, the host's files, files
    being written, files still growing."""
    from snapshotter.commit.push import grown_line

    if result.skipped_secrets:
        say(f"left out {len(result.skipped_secrets)} secret-looking path(s) (set include_secrets in the profile to "
            "keep them):")
        for p in result.skipped_secrets:
            say(f"  {'/' + p!r}")
    if result.unreadable:
        say(f"left out {len(result.unreadable)} path(s) snap may not read (run snap as root, or exclude them in the "
            "profile): " + ", ".join(repr("/" + p) for p in result.unreadable[:20])
            + (f" and {len(result.unreadable) - 20} more" if len(result.unreadable) > 20 else ""))
    if result.host_files:
        say(f"left out {len(result.host_files)} file(s) bind-mounted from the host (GPU driver files and links to "
            "them; the next host's runtime mounts its own): " + ", ".join(repr("/" + p) for p in result.host_files))
    for path, why in sorted(result.held.items())[:20]:
        kept = ("kept the last snapshot's version" if path in result.carried
                else "left out (the base's version, if any, stays)")
        say(f"held back: {'/' + path!r} ({why}): never read half-written; {kept}; commit again once it is written")
    if len(result.held) > 20:
        say(f"held back {len(result.held) - 20} more file(s) being written")
    for path, size in sorted(result.grown.items()):
        say(grown_line(path, size))


def commit_pushed(result) -> None:
    say(f"base: {result.base_layers} layer(s); deleted paths: {result.deleted}")
    for layer in result.layers:
        kind = layer.media_type.rsplit(".", 1)[-1]
        out(f"{layer.name}: {layer.status}  [{human_size(layer.size)}, {kind}, {layer.entries} entries, "
            f"{layer.digest[:19]}]")
    if not result.layers:
        out("no changes against the base: the snapshot is the base image")
    if result.references:
        out(f"weights from the origin: {result.references} hub file(s), {human_size(result.reference_bytes)}, kept "
            "as references (not uploaded; `snap restore` fetches them, `snap commit --upload-origin` uploads them)")
    if result.origin_uploaded:
        out(f"weights from the origin: {result.origin_uploaded} hub file(s) held in the layers (self-contained)")
    if result.uploaded_bytes or not result.current:  # a current tag's headers artifact may have been re-tagged
        out(result.sent())
    if result.current:  # as the watcher says it
        out(f"nothing changed: {result.ref.name}:{result.ref.tag} is current")
        return
    out(f"pushed {result.ref}")


def restored(result, root: str, json_out: bool) -> None:
    if result.skipped_devices_count:
        say(f"skipped {result.skipped_devices_count} device node(s) and FIFO(s) (pass --allow-devices, as root for "
            "device nodes, to create them)")
    if result.stripped_setuid_count:
        say(f"stripped setuid/setgid from {result.stripped_setuid_count} file(s) (pass --allow-setuid as root to "
            "keep them)")
    if json_out:
        as_json(with_ref(result))
        return
    out(f"restored {result.ref} into {root}: {len(result.applied)} layer(s) applied"
        f"{f', {result.resumed} already applied' if result.resumed else ''}"
        f"{f', {result.skipped_layers} already there (not downloaded)' if result.skipped_layers else ''}, "
        f"{result.files} files, {human_size(result.bytes)}")
    if result.origin_fetched or result.origin_present:
        out(f"weights from the origin: {result.origin_fetched} file(s) fetched, {result.origin_present} already there")
    if result.seeded_layers:
        say(f"stat cache: the next commit of {root} will not re-read the {result.seeded_layers} snap layer(s) "
            "left unchanged")


def verified(result, root: str, json_out: bool) -> None:
    """The differences (exit 9 is the caller's), then the verdict."""
    if json_out:
        as_json({"ref": str(result.ref), "manifest_digest": result.manifest_digest, "checked": result.checked,
                 "ok": result.ok, "differences": [asdict(d) for d in result.differences],
                 "left_out_secrets": result.left_out_secrets, "left_out_total": result.left_out_total,
                 "layers_read": result.layers_read, "layers_held": result.layers_held})
        return
    for d in result.differences:
        out(str(d))
    for p in result.left_out_secrets:
        out(f"left out (secret): {p!r}")
    if result.left_out_total > len(result.left_out_secrets):
        out(f"left out (secret): {result.left_out_total - len(result.left_out_secrets)} more, not listed in the image")
    if not result.ok:
        return
    if result.left_out_total:
        # Not a difference (no restore can bring them back: the image never held them), not a plain match either.
        out(f"verified {result.ref}: {root} matches ({result.checked} paths), except {result.left_out_total} "
            "path(s) the commit left out as secrets (not in the image)")
    else:
        out(f"verified {result.ref}: {root} matches ({result.checked} paths)")


def snapshots(snaps, tag: str, json_out: bool) -> None:
    """`snap log`: each snapshot and the layers new in it, then the diverged tags of `tag`."""
    if json_out:
        as_json([asdict(s) for s in snaps])
        return
    for s in snaps:
        out(f"{', '.join(s.tags)}  {utc(s.created)}  {human_size(s.size)}  {s.digest[:19]}  base {s.base}")
        if s.origin_files:
            out(f"    depends on the origin: {s.origin_files} hub file(s), {human_size(s.origin_bytes)}, kept as "
                "references (`snap commit --upload-origin` makes it self-contained)")
        for layer in s.new:
            out(f"    new: {layer.label}  {human_size(layer.size)}")
        if not s.new:
            out("    no new layers")
    apart = sorted((name, s) for s in snaps for name in s.diverged)
    if apart:
        out(f"diverged from {tag} (boxes that could not move it saved their work there; docs/watch.md: look, adopt):")
        for name, s in apart:
            out(f"    {name}  {utc(s.created)}  {s.digest}")


def box_status(st, json_out: bool) -> None:
    """`snap status`: each layer, changed or not, then the tag and the diverged tags."""
    if json_out:
        as_json({**asdict(st), "to_send": st.to_send})
        return
    for layer in st.layers:
        what = "changed, would send" if layer.changed else "unchanged, skipped"
        out(f"{layer.label}: {what}  [{human_size(layer.size)}, {layer.entries} entries]")
    changed = sum(1 for layer in st.layers if layer.changed)
    out(f"{changed} of {len(st.layers)} layer(s) changed against base {st.base}, "
        f"{human_size(st.to_send)} of files to send; {st.deleted} deleted path(s)")
    if st.tags_error:
        out(f"tag {st.tag}: not looked up ({st.tags_error})")
    elif st.tag:
        whose = ("this box may move it" if st.movable else
                 "a snapshot this box neither came from nor made: its snapshots go to a diverged tag")
        out(f"tag {st.tag}: {st.tag_digest or 'no such tag yet'} ({whose})")
        if st.tag_origin_files:
            out(f"tag {st.tag}: depends on the origin for {st.tag_origin_files} hub file(s) kept as references")
    if st.references:
        out(f"weights from the origin: a commit keeps {st.references} hub file(s) as references, not uploaded")
    for d in st.diverged:
        out(f"diverged: {d.tag}  {utc(d.created)}  {d.digest}" + ("  (this box's)" if d.own else ""))
