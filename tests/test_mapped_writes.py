"""A file some process maps shared-writable: the kernel moves its times at the first write to a
clean page only, and the writes after it change no stat data (on tmpfs for good, on ext4 until
writeback). Its stat data is never trusted: its layer is read by each commit, never put into the
stat cache, and its path never kept by the walk memo, so the commit after the writer is gone reads
it again too. (commit/model.py's CommitPlan.writing)"""

import os
import subprocess

import pytest

from snapshotter import CommitOptions, commit_box, restore_image
from snapshotter.box import memo as memo_module
from snapshotter.commit import model as model_module
from snapshotter.commit import push as push_module

from support.images import layer_tar, layers_by_name
from support.mapped import MappedWriter, held, mapped_name, stat_data
from support.trees import write_tree

STATE = "opt/app/db/state.bin"


def image_bytes(registry, repo: str, tag: str, rel: str) -> bytes:
    """`rel` as the image's own layers hold it (the topmost layer that has it)."""
    found = None
    for desc in layers_by_name(registry.manifest(repo, tag)).values():
        with layer_tar(registry, repo, desc) as t:
            for m in t.getmembers():
                if m.name.rstrip("/") == rel and m.isreg():
                    found = t.extractfile(m).read()
    assert found is not None, f"{rel} is in no layer of {repo}:{tag}"
    return found


@pytest.fixture
def old_box(box, monkeypatch):
    """The box's files count as old (a real box's are older than the racy windows), and a file
    written a moment ago is not held back as being written (the hold is another rule)."""
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 0)
    monkeypatch.setattr(memo_module, "RACY_WINDOW_NS", 0)
    monkeypatch.setattr(model_module, "WRITING_QUIET_S", 0)
    return box


@pytest.mark.parametrize("via", ["box", "hardlink", "hardlink-gone", "bind"])
def test_writes_through_a_shared_map_that_change_no_stat_data_are_committed(registry, base_ref, old_box,
                                                                            tmp_path, via):
    """Whatever name the writer mapped the file by (/proc shows that one): the box's own, a hard
    link outside the box, the box's directory bind-mounted elsewhere. The file is known by its
    identity (box/writers.py's mapped_ids), also once the other name is gone ("hardlink-gone": /proc
    then says the mapped file is deleted)."""
    path = os.path.join(old_box, STATE)
    write_tree(old_box, {STATE: b"\0" * 8192})
    repo = f"mapped-{via}"
    with mapped_name(path, str(tmp_path / "elsewhere"), via.removesuffix("-gone")) as name:
        _commit_writes_through_a_map(registry, base_ref, old_box, name, repo, unlink=via.endswith("-gone"))
    out = tmp_path / "out"
    restore_image(f"{registry.host}/{repo}:v3", str(out))
    assert (out / STATE).read_bytes() == b"CCCC" + b"\0" * 8188


def _commit_writes_through_a_map(registry, base_ref, old_box, name: str, repo: str, unlink: bool) -> None:
    path = os.path.join(old_box, STATE)
    writer = MappedWriter(name)
    try:
        writer.write("AAAA")  # the first write to the clean page moves the file's times
        if unlink:
            os.unlink(name)  # the map holds the file; the box's name stays
        first = commit_box(f"{registry.host}/{repo}:v1", base_ref, CommitOptions(root=old_box))
        assert image_bytes(registry, repo, "v1", STATE)[:4] == b"AAAA"
        before = stat_data(path)
        writer.write("BBBB")  # the page is dirty already: nothing of its stat data moves
        if stat_data(path) != before:
            pytest.skip("this filesystem moves a file's times at every write through a map")
        second = commit_box(f"{registry.host}/{repo}:v2", base_ref, CommitOptions(root=old_box))
        assert image_bytes(registry, repo, "v2", STATE)[:4] == b"BBBB"
        assert [x.digest for x in second.layers] != [x.digest for x in first.layers]
        writer.write("CCCC")
        if stat_data(path) != before:
            pytest.skip("this filesystem moves a file's times at every write through a map")
    finally:
        writer.exit()
    # The writer is gone, the file's stat data still as when the second commit read BBBB: the
    # stat cache must not have kept that layer for it.
    assert stat_data(path) == before
    commit_box(f"{registry.host}/{repo}:v3", base_ref, CommitOptions(root=old_box))
    assert image_bytes(registry, repo, "v3", STATE)[:4] == b"CCCC"


def test_a_file_mapped_for_writing_is_read_again_but_sent_only_when_changed(registry, base_ref, old_box):
    """Its layer is built and its digest compared: the same bytes are not sent again; the box's
    other layers come from the stat cache, unread, as ever."""
    write_tree(old_box, {STATE: b"\0" * 8192})
    writer = MappedWriter(os.path.join(old_box, STATE))
    try:
        writer.write("AAAA")
        commit_box(f"{registry.host}/mapped-same:v1", base_ref, CommitOptions(root=old_box))
        again = commit_box(f"{registry.host}/mapped-same:v2", base_ref, CommitOptions(root=old_box))
    finally:
        writer.exit()
    statuses = {layer.name: layer.status for layer in again.layers}
    read = [name for name, status in statuses.items() if "not read" not in status]
    assert len(read) == 1 and statuses[read[0]] == "exists, skipped", statuses
    assert again.uploaded.get("layers", 0) == 0, again.uploaded


def test_a_file_mapped_for_writing_keeps_the_plan_only_while_its_stat_data_is_the_same(registry, base_ref, old_box,
                                                                                       monkeypatch):
    """The kept walk holds no file some process maps (snapshot/kept.py): the kept plan is reused
    while such a file's entry is as the plan had it, and made again when it moved (it grew)."""
    planned = []
    real = model_module.plan_layers
    monkeypatch.setattr(model_module, "plan_layers", lambda *a, **kw: planned.append(1) or real(*a, **kw))
    path = os.path.join(old_box, STATE)
    write_tree(old_box, {STATE: b"\0" * 8192})
    writer = MappedWriter(path)
    try:
        writer.write("AAAA")
        for tag in ("v1", "v2"):
            commit_box(f"{registry.host}/mapped-plan:{tag}", base_ref, CommitOptions(root=old_box))
        assert len(planned) == 1
        os.truncate(path, 3 * 8192)  # its size and times move; the kept walk's digest would not
        commit_box(f"{registry.host}/mapped-plan:v3", base_ref, CommitOptions(root=old_box))
    finally:
        writer.exit()
    assert len(planned) == 2
    assert image_bytes(registry, "mapped-plan", "v3", STATE) == b"AAAA" + b"\0" * (3 * 8192 - 4)


@pytest.mark.parametrize("how", ["open for append", "mapped to be read"])
def test_a_file_held_but_never_written_through_a_map_keeps_its_stat_cache(registry, base_ref, old_box, how):
    """write(2) moves a file's times whenever the clock has moved: a file a process only holds open
    for writing (a log) is trusted to its stat data as any other. So is one opened read-only and
    mapped shared (a weight: numpy, safetensors): no write can come through that map. Its layer
    comes from the stat cache, unread."""
    write_tree(old_box, {STATE: b"a log line\n"})
    repo = how.replace(" ", "-")
    with held(os.path.join(old_box, STATE), how):
        commit_box(f"{registry.host}/{repo}:v1", base_ref, CommitOptions(root=old_box))
        again = commit_box(f"{registry.host}/{repo}:v2", base_ref, CommitOptions(root=old_box))
    assert all("not read" in layer.status for layer in again.layers), {x.name: x.status for x in again.layers}


def test_a_shared_map_switched_read_only_between_writes_still_counts(registry, base_ref, old_box):
    """A map of a file opened for writing, read-only (mprotect) while a commit looks: it may be made
    writable again, and its dirty pages then take writes with no fault, so no time moves. It counts
    as long as it may be written (VM_MAYWRITE), read-only now or not."""
    path = os.path.join(old_box, STATE)
    write_tree(old_box, {STATE: b"\0" * 8192})
    writer = MappedWriter(path)
    try:
        writer.write("AAAA")
        writer.write("!ro")
        commit_box(f"{registry.host}/mapped-ro:v1", base_ref, CommitOptions(root=old_box))
        assert image_bytes(registry, "mapped-ro", "v1", STATE)[:4] == b"AAAA"
        before = stat_data(path)
        for word in ("!rw", "BBBB", "!ro"):
            writer.write(word)
        if stat_data(path) != before:
            pytest.skip("this kernel moves a file's times at a write through a map made writable again")
        commit_box(f"{registry.host}/mapped-ro:v2", base_ref, CommitOptions(root=old_box))
    finally:
        writer.exit()
    assert image_bytes(registry, "mapped-ro", "v2", STATE)[:4] == b"BBBB"


def test_smaps_tells_a_map_that_may_write_from_one_that_may_not(old_box):
    """Where map_files is closed to snap (not root), smaps' VmFlags tell the maps of a file opened for
    writing (read-only now or not) from those of a file opened read-only."""
    from snapshotter.box.writers import _smaps_may_write

    written, read = os.path.join(old_box, STATE), os.path.join(old_box, "opt/app/db/weights.bin")
    write_tree(old_box, {STATE: b"\0" * 8192, "opt/app/db/weights.bin": b"\0" * 8192})
    writer = MappedWriter(written)
    try:
        writer.write("!ro")
        with held(read, "mapped to be read") as reader:
            spans = {}
            for pid in (writer.proc.pid, reader):
                with open(f"/proc/{pid}/maps", "rb") as f:
                    for line in f:
                        fields = line.split(None, 5)
                        if len(fields) == 6 and fields[5].strip().decode() in (written, read):
                            spans[fields[5].strip().decode()] = (pid, fields[0])
            assert set(spans) == {written, read}, spans
            assert {path: span in _smaps_may_write(f"/proc/{pid}") for path, (pid, span) in spans.items()} == \
                {written: True, read: False}
    finally:
        writer.exit()



@pytest.mark.skipif(os.geteuid() != 0, reason="mounts the state dir's walk-memo folder read-only")
def test_a_walk_the_state_dir_had_no_room_for_keeps_no_plan(registry, base_ref, old_box, state_dir, tmp_path):
    """The walk memo could not be written (its disk full or read-only: state.if_room skips it) while
    a file is mapped for writing: the kept plan, whose key would then name that file alone, is not
    reused, and a file changed since is sent."""
    write_tree(old_box, {STATE: b"\0" * 8192, "opt/app/notes.txt": "version one\n"})
    writer = MappedWriter(os.path.join(old_box, STATE))
    memo = state_dir / "walk-memo"
    try:
        writer.write("AAAA")
        commit_box(f"{registry.host}/mapped-nowalk:v1", base_ref, CommitOptions(root=old_box))
        subprocess.run(["mount", "--bind", str(memo), str(memo)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(memo)], check=True)
            for tag, text in (("v2", "version one!\n"), ("v3", "VERSION TWO, longer\n")):
                write_tree(old_box, {"opt/app/notes.txt": text})
                commit_box(f"{registry.host}/mapped-nowalk:{tag}", base_ref, CommitOptions(root=old_box))
        finally:
            subprocess.run(["umount", "-l", str(memo)], check=True)
    finally:
        writer.exit()
    out = tmp_path / "out"
    restore_image(f"{registry.host}/mapped-nowalk:v3", str(out))
    assert (out / "opt/app/notes.txt").read_text() == "VERSION TWO, longer\n"
