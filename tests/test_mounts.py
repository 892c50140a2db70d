"""The one mountinfo parser (snapshotter/box/mounts.py), used by the box scan and by restore."""

from snapshotter.box.mounts import Mount, inside, parse_mountinfo, pseudo_mounts

MOUNTINFO = (
    "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
    "23 22 0:21 / /proc rw,nosuid shared:12 - proc proc rw\n"
    "40 22 8:1 /srv/src /srv/mod\\040\u00e8le rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
    "41 22 8:1 /x /srv/tab\\011and\\134back\\012line rw master:3 - tmpfs none rw\n"
    "42 22 0:5 /libcuda.so.555.42.06 /usr/lib/x86_64-linux-gnu/libcuda.so.555.42.06 ro,nosuid - overlay overlay ro\n"
    "garbage line without the separator\n"
).encode("utf-8") + b"43 22 8:1 / /srv/latin\\040\xe9 rw - ext4 /dev/sda1 rw\n"  # not UTF-8: kept as os.fsdecode does


def test_octal_escapes_and_non_ascii_mount_points():
    mounts = parse_mountinfo(MOUNTINFO)
    assert mounts[:5] == [
        Mount("/", "ext4"),
        Mount("/proc", "proc"),
        Mount("/srv/mod \u00e8le", "ext4"),  # not "/srv/mod \u00c3\u00a8le" (escapes decoded as text)
        Mount("/srv/tab\tand\\back\nline", "tmpfs"),
        Mount("/usr/lib/x86_64-linux-gnu/libcuda.so.555.42.06", "overlay"),
    ]
    assert mounts[5] == Mount("/srv/latin \udce9", "ext4")
    assert len(mounts) == 6  # the malformed line is skipped


def test_inside():
    assert inside("/box", "/box") == ""
    assert inside("/box", "/box/usr/lib/a") == "usr/lib/a"
    assert inside("/box", "/boxer/a") is None
    assert inside("/", "/proc") == "proc"


def test_scan_sees_the_proc_mount():
    assert "proc" in pseudo_mounts("/")
