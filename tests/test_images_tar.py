"""The archives ``nbox images build`` hands the engine: two archives in a row read as one (``docker import`` of a
base's export and the wheels), and GNU tar's layout of the staged folders (image paths, root-owned, no folder
named twice), and what an interrupted mmdebstrap leaves (removed, unless a mount is left in it)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile

import pytest

from neuronabox.cluster.images import _members, _mounts_under, _remove_unmounted, _tar_command
from neuronabox.errors import RunFailed


def archive(members: dict[str, bytes], fmt=tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_an_archive_without_its_end_then_another_read_as_one(fmt):
    long = "usr/lib/" + "x" * 180 + "/file.py"  # longer than a header holds: a pax or GNU long-name entry first
    first = archive({"etc/hostname": b"node\n", long: b"a" * 1000, "empty": b""}, fmt)
    second = archive({"usr/lib/python3/dist-packages/torch/__init__.py": b"b" * 513})
    # Chunks of odd sizes, as the engine's export arrives.
    chunks = [first[i:i + 777] for i in range(0, len(first), 777)]
    joined = b"".join(_members(chunks)) + second
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert got == {"etc/hostname": b"node\n", long: b"a" * 1000, "empty": b"",
                   "usr/lib/python3/dist-packages/torch/__init__.py": b"b" * 513}


@pytest.mark.skipif(not shutil.which("tar"), reason="needs GNU tar")
def test_staged_folders_go_in_under_their_image_paths_owned_by_root_without_the_folder_itself(tmp_path):
    site = tmp_path / "nbox-site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "a.py").write_text("x = 1\n")
    (site / "top.pth").write_text("pkg\n")
    script = tmp_path / "nbox-script"
    script.write_text("#!/usr/bin/python3\n")
    out = subprocess.run(_tar_command({"/usr/lib/python3/dist-packages": site, "/usr/local/bin/nbox": script}),
                         capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        members = tar.getmembers()
    assert sorted(m.name for m in members) == ["usr/lib/python3/dist-packages/pkg", "usr/lib/python3/dist-packages/pkg/a.py",
                                               "usr/lib/python3/dist-packages/top.pth", "usr/local/bin/nbox"]
    assert {(m.uid, m.gid) for m in members} == {(0, 0)}


def test_what_an_interrupted_mmdebstrap_leaves_is_removed(tmp_path):
    """Its gpg home (left when a Ctrl-C lands before its END blocks run) goes with its own folder."""
    own = tmp_path / "nbox-images-mmdebstrap-x"
    (own / "mmdebstrap.gpghome.abc").mkdir(parents=True)
    (own / "mmdebstrap.gpghome.abc" / "trustdb.gpg").write_bytes(b"")
    _remove_unmounted(own)
    assert not own.exists()
    _remove_unmounted(own)  # already gone: nothing to do


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_chroot_with_a_mount_left_in_it_is_named_not_walked_into(tmp_path):
    """A killed mmdebstrap can leave /dev mounted in its chroot: removing the folder would empty the host's."""
    own = tmp_path / "nbox-images-mmdebstrap-y"
    dev = own / "mmdebstrap.chroot" / "dev"
    dev.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(dev)], check=True)
    try:
        (dev / "keep").write_text("x")
        assert _mounts_under(own) == [str(dev)]
        with pytest.raises(RunFailed, match=f"{dev} mounted"):
            _remove_unmounted(own)
        assert (dev / "keep").exists()
    finally:
        subprocess.run(["umount", str(dev)], check=True)
    _remove_unmounted(own)
    assert not own.exists()
