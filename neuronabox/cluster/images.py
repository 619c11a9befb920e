"""Images of the docker runtime, built without a registry: ``nbox images build``.

Nothing here is pulled. Each image is made in three steps, each one an image tagged by the hash
of what it is made of, so that a step whose inputs did not change is found in the engine and not
made again (a second ``build`` takes seconds):

1. the **base**: a Debian rootfs made by ``mmdebstrap --variant=minbase`` (python3, iproute2,
   iptables, ping, ps) and ``docker import``-ed; or the image the user names (``--base-image``,
   e.g. an NVIDIA CUDA image for a GPU node), completed with the same Debian packages by apt;
2. the **dependencies**: the Python packages the image needs, installed on the host by pip
   (``pip install --target`` for the image's Python, wheels only) and imported with the base's
   files as one layer (``_import_on``; on a user's base, put into a container of it, which is
   committed: ``_add_layer``); the stub image
   carries no torch, the node image adds torch (the CPU wheel unless ``--torch`` names another);
3. **neuronabox** itself, one wheel of this checkout (``pip wheel --no-deps``) shared by the images,
   and an ``nbox`` script.

``prometheus`` is Debian's own ``prometheus`` package, installed by apt on the Debian base (no
registry image; one rootfs for all three images).

A cold build starts at once everything it needs that waits on nobody (the base, the wheels of
each image, the project's wheel) and stages in memory where a tmpfs has room (``scratch_dir``).
The engine is reached through the Docker SDK only (``docker_runtime.client``). A build that is
interrupted leaves no tag: each tag is set by the engine's last step; the staging container,
the staging folder and mmdebstrap's chroot and gpg home are removed on the way out.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..errors import InputError, RunFailed

__all__ = ["build", "IMAGES", "Built", "image_ref", "SUITE", "BASE_PACKAGES", "STUB_REQUIREMENTS"]

IMAGES = ("stub", "node", "prometheus")
SUITE = "bookworm"
MIRROR = os.environ.get("NBOX_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What every node, stub and agent runs: python3 for neuronabox, iproute2/iptables for the
# shaping (tc, the delay relay's rules), ping and ps for the user poking around.
BASE_PACKAGES = ("python3", "iproute2", "iptables", "iputils-ping", "procps")
PYTHON_VERSION = "3.11"  # bookworm's python3
# What the stub peer and the shaping agent import (no torch, no numpy, no matplotlib).
STUB_REQUIREMENTS = ("pydantic>=2.6", "PyYAML>=6.0", "typer>=0.12", "rich>=13.0", "prometheus-client>=0.19",
                     "psutil>=5.9", "pyroute2>=0.7.12")
TORCH_CPU = "torch==2.13.0"
# Debian's version-independent site folder: on sys.path of every python3 the distribution ships.
SITE = "/usr/lib/python3/dist-packages"
# Docs, man pages and translations are a third of a minbase rootfs and nobody reads them in a node.
_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*")
_NBOX_SCRIPT = "#!/usr/bin/python3\nimport sys\nfrom neuronabox.cli import main\nsys.exit(main())\n"


@dataclass(frozen=True)
class Built:
    """One image after ``build``: its reference, whether it was already there, its size in bytes."""

    name: str
    ref: str
    cached: bool
    size: int
    seconds: float


def image_ref(name: str, tag: str = "latest") -> str:
    """The reference the runtime and the compose file use for image ``name``."""
    return f"neuronabox/{name}:{tag}"


def _hash(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _tree_hash(root: Path) -> str:
    """Hash of the package's source files (names and contents), caches and bytecode aside."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"):
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _exists(client, ref: str) -> bool:
    from docker.errors import ImageNotFound

    try:
        client.images.get(ref)
        return True
    except ImageNotFound:
        return False


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
    """Run a build step; on an interrupt, stop it with SIGTERM so that it removes its own work folder."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = p.communicate()
    except BaseException:
        # subprocess.run would SIGKILL it: mmdebstrap would leave its chroot in /tmp behind.
        p.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(60)
        raise
    if p.returncode != 0:
        said = err.strip().splitlines() or out.strip().splitlines() or ["(no output)"]
        # pip ends with a decoration ("╰─> neuronabox"): the line that names the error says more.
        tail = next((ln.strip() for ln in reversed(said) if "error" in ln.lower()), said[-1])
        raise RunFailed(f"images build: {what} failed ({p.returncode}): {tail}")


def _mounts_under(folder: Path) -> list[str]:
    """The mount points at or below ``folder``, from this process's mountinfo."""
    top = str(folder.resolve())
    with open("/proc/self/mountinfo") as f:
        # Field 5 is the mount point, with space, tab, newline and backslash octal-escaped (\040).
        points = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), ln.split()[4]) for ln in f)
        return [m for m in points if m == top or m.startswith(top + "/")]


def _remove_unmounted(folder: Path) -> None:
    """Remove what a build step left in ``folder``, unless something is still mounted there.

    An interrupted mmdebstrap may leave its gpg home (it removes it only on a normal exit), or, when
    killed outright, its chroot with /proc and /dev still mounted: removing that would walk into the
    host's /dev, so it is left and named."""
    if not folder.exists():
        return
    mounted = _mounts_under(folder)
    if mounted:
        raise RunFailed(f"images build: {folder} still has {mounted[0]} mounted; "
                        f"umount it (umount -R {mounted[0]}) and remove {folder}")
    shutil.rmtree(folder, ignore_errors=True)


def scratch_dir() -> str | None:
    """Where a build stages its files and mmdebstrap its chroots: a roomy tmpfs (/dev/shm), else None (TMPDIR).

    A cold build writes some 3 GB there (two chroots and their tars, torch unpacked) and removes it;
    in memory, dpkg's fsyncs and pip's and rmtree's many small files cost nothing, where on a disk
    that the machine's other work also writes they were a third of a cold build."""
    shm = Path("/dev/shm")
    try:
        st = os.statvfs(shm)
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
        with open("/proc/mounts") as f:
            opts = next((ln.split()[3].split(",") for ln in f if ln.split()[1] == str(shm) and ln.split()[2] == "tmpfs"),
                        None)
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    # noexec/nodev would break mmdebstrap's chroot; 8 GB free on both counts leaves the machine room.
    if opts is None or "noexec" in opts or "nodev" in opts or min(st.f_bavail * st.f_frsize, avail) < 8 << 30:
        return None
    return str(shm)


def _debian_rootfs(client, ref: str, packages: Sequence[str], changes: Sequence[str], work: Path, say) -> None:
    """``mmdebstrap`` a minbase rootfs with ``packages`` and import it as ``ref``."""
    exe = shutil.which("mmdebstrap")
    if exe is None:
        raise InputError("images build: mmdebstrap is not installed (apt-get install mmdebstrap), "
                         "or name a base with --base-image")
    tar = work / f"{ref.replace('/', '_').replace(':', '_')}.tar"
    # One cache per rootfs: two mmdebstraps at once never copy into the same folder.
    cache = Path(os.environ.get("NBOX_DEB_CACHE", Path.home() / ".cache" / "neuronabox" / "debs")) / packages[0]
    cache.mkdir(parents=True, exist_ok=True)
    say(f"mmdebstrap {SUITE} with {', '.join(packages)} (a minute or three when the .debs are not cached)")
    cmd = [exe, "--quiet", "--variant=minbase", f"--include={','.join(packages)}",
           # A merged /usr without the usrmerge package, which would pull in perl (40 MB).
           "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
           *(f"--dpkgopt=path-exclude={p}" for p in _EXCLUDES),
           # The downloaded .debs are kept on the host for the next build.
           "--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives",
           f"--setup-hook=sync-in {cache} /var/cache/apt/archives",
           f"--customize-hook=sync-out /var/cache/apt/archives {cache}",
           "--customize-hook=rm -rf \"$1\"/var/cache/apt/archives/*.deb \"$1\"/var/lib/apt/lists/*",
           SUITE, str(tar), MIRROR]
    # Its chroot and gpg home in a folder of its own beside our staging folder (the tmpfs when there
    # is one): not inside it, where the staging folder's removal could walk into a mount that a
    # killed mmdebstrap left on its chroot.
    own = Path(tempfile.mkdtemp(prefix="nbox-images-mmdebstrap-", dir=work.parent))
    try:
        _run(cmd, "mmdebstrap", env={**os.environ, "TMPDIR": str(own)})
    finally:
        _remove_unmounted(own)
    repo, tag = ref.rsplit(":", 1)
    say(f"docker import {ref}")
    client.api.import_image_from_file(str(tar), repository=repo, tag=tag, changes=list(changes))
    tar.unlink()


def _docker_build(client, ref: str, dockerfile: str, files: dict[str, Path], work: Path, labels: dict, say) -> None:
    """``docker build`` of ``dockerfile`` with ``files`` (name in the context -> host path) as its context."""
    ctx = work / f"ctx-{ref.replace('/', '_').replace(':', '_')}"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(dockerfile)
    for name, src in files.items():
        os.replace(src, ctx / name)
    say(f"docker build {ref}")
    from docker.errors import BuildError

    try:
        # forcerm: a failed or interrupted step leaves no intermediate container behind.
        client.images.build(path=str(ctx), tag=ref, rm=True, forcerm=True, labels=labels, nocache=False)
    except BuildError as exc:
        raise RunFailed(f"images build: {ref}: {exc.msg}") from None
    finally:
        shutil.rmtree(ctx, ignore_errors=True)


@contextlib.contextmanager
def _staging(client, parent: str, ref: str, files: dict[str, Path]):
    """A stopped container of ``parent`` and a running GNU tar of ``files``; both gone on the way out.

    Yields ``(container, tar_chunks, tar_failed)``: the archive's chunks, then a check that says why tar failed
    (None when it did not)."""
    container = client.containers.create(parent, ["true"], labels={"nbox.build": ref})
    tar = None
    try:
        tar = subprocess.Popen(_tar_command(files), stdout=subprocess.PIPE, stderr=subprocess.PIPE)

        def chunks():
            while chunk := tar.stdout.read(1 << 20):
                yield chunk

        def failed() -> str | None:
            if tar.wait() == 0:
                return None
            return (f"images build: tar of {', '.join(map(str, files.values()))} failed: "
                    f"{tar.stderr.read().decode(errors='replace').strip()}")

        yield container, chunks, failed
    finally:
        # Also on an interrupt: the staging container never outlives the build, nor the tar its reader.
        if tar is not None and tar.poll() is None:
            tar.kill()
            tar.wait()
        container.remove(force=True)


def _add_layer(client, parent: str, ref: str, files: dict[str, Path], changes: Sequence[str], say) -> None:
    """Image ``ref``: ``parent`` with the host folders ``files`` (image path -> host path) put in, one layer.

    A container's archive upload and a commit: a third of the time ``docker build``'s COPY took for
    torch's gigabyte here (the build context is written once more, then copied, then committed)."""
    say(f"adding {', '.join(files)} to {parent} as {ref}")
    with _staging(client, parent, ref, files) as (container, tar_chunks, tar_failed):
        container.put_archive("/", tar_chunks())
        if why := tar_failed():
            raise RunFailed(why)
        repo, tag = ref.rsplit(":", 1)
        container.commit(repo, tag, changes=list(changes))


def _import_on(client, parent: str, ref: str, files: dict[str, Path], changes: Sequence[str], say) -> None:
    """Image ``ref``: ``parent``'s files and the host folders ``files`` (image path -> host path), one layer, made by
    one ``docker import`` of the two archives in a row (``parent``'s export without its end, then ours)."""
    say(f"importing {parent} with {', '.join(files)} as {ref}")
    with _staging(client, parent, ref, files) as (container, tar_chunks, tar_failed):

        def chunks():
            yield from _members(container.export(chunk_size=1 << 20))
            yield from tar_chunks()

        repo, tag = ref.rsplit(":", 1)
        client.api.import_image_from_data(chunks(), repository=repo, tag=tag, changes=list(changes))
        if why := tar_failed():
            # The import took a cut archive: its tag is not what it says.
            with contextlib.suppress(Exception):
                client.images.remove(ref, force=True)
            raise RunFailed(why)


def _members(stream):
    """A tar archive's bytes (an iterable of chunks) without its end (the zero blocks), so that another can follow."""
    buf = bytearray()
    chunks = iter(stream)

    def take(n: int) -> bytes | None:
        while len(buf) < n:
            chunk = next(chunks, None)
            if chunk is None:
                return None
            buf.extend(chunk)
        out = bytes(buf[:n])
        del buf[:n]
        return out

    while (header := take(512)) is not None and header.strip(b"\0"):
        field = header[124:136]
        # The size: octal text, or base-256 (first byte's high bit) for 8 GiB and more.
        size = (int.from_bytes(field[1:], "big") if field[0] & 0x80
                else int(field.split(b"\0", 1)[0].strip() or b"0", 8))
        yield header
        padded = -(-size // 512) * 512
        while padded:
            part = take(min(padded, 1 << 20))
            if part is None:
                raise RunFailed("images build: the engine's export of the base ended inside a file")
            yield part
            padded -= len(part)


def _tar_command(files: dict[str, Path]) -> list[str]:
    """GNU tar writing ``files`` (image path -> host path) as one archive, owned by root, to its stdout.

    A folder's contents go in, not the folder itself: its image path exists below (Debian's
    dist-packages), and ``docker import`` refuses an archive that names a path twice.
    tar, not Python's tarfile: a tenth of the CPU for torch's gigabyte (1.4 s against 11 s here)."""
    cmd = ["tar", "--create", "--file=-", "--owner=0", "--group=0", "--numeric-owner"]
    names: list[str] = []
    for dest, src in files.items():
        if not re.fullmatch(r"[A-Za-z0-9_-]+", src.name):
            raise ValueError(f"staging name {src.name!r}")  # our own names: the patterns below need no escaping
        # Each host path's own name becomes its image path (S: symbolic link targets are left as they are).
        if src.is_dir():
            cmd.append(f"--transform=s,^{src.name}/,{dest.strip('/')}/,S")
            names += ["-C", str(src.parent), *(f"{src.name}/{c}" for c in sorted(os.listdir(src)))]
        else:
            cmd.append(f"--transform=s,^{src.name}$,{dest.strip('/')},S")
            names += ["-C", str(src.parent), src.name]
    return cmd + names


def _project_requirements(root: Path) -> list[str]:
    """neuronabox's own dependencies (no extras), as the installed checkout declares them."""
    from importlib.metadata import requires

    # The checkout is installed editable (make venv), so its metadata follows pyproject.toml.
    return sorted(r for r in (requires("neuronabox") or []) if "extra ==" not in r)


def _apt_install(packages: Sequence[str]) -> str:
    """A Dockerfile step that installs Debian ``packages`` (no recommends), keeping no lists, .debs or caches (75 MB)."""
    return (f"RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
            f"{' '.join(packages)} && apt-get clean && rm -rf /var/lib/apt/lists/*\n")


def _requirements(name: str, root: Path, torch: str) -> tuple[str, ...]:
    """The Python packages image ``name`` holds besides neuronabox: the stub's few, or all of neuronabox's and torch."""
    return STUB_REQUIREMENTS if name == "stub" else (*_project_requirements(root), torch)


def _pip_target(target: Path, args: Sequence[str], python_version: str, say, binary_only: bool = True) -> None:
    """``pip install --target`` for the image's Python (CPython ``python_version``, x86_64 glibc)."""
    say(f"pip install {' '.join(args)} for python {python_version}")
    platform = ["--only-binary=:all:", "--implementation", "cp", "--python-version", python_version,
                "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux_2_28_x86_64"] if binary_only else []
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--no-warn-script-location",
          "--target", str(target), *platform, *args], "pip install " + " ".join(args))
    # The images run neuronabox through their own interpreter; host-made scripts point at the host's.
    shutil.rmtree(target / "bin", ignore_errors=True)


def build(
    which: Sequence[str] = IMAGES,
    *,
    tag: str = "latest",
    base_image: str | None = None,
    python_version: str = PYTHON_VERSION,
    torch: str = TORCH_CPU,
    client=None,
    progress: Callable[[str], None] | None = None,
) -> list[Built]:
    """Build (or find cached) the images in ``which`` and tag each ``neuronabox/<name>:<tag>``."""
    import time

    from .compose import repo_root
    from .docker_runtime import client as engine_client

    say = progress or (lambda msg: None)
    bad = [w for w in which if w not in IMAGES]
    if bad:
        raise InputError(f"images build: no image named {bad[0]!r} (expected {', '.join(IMAGES)})")
    root = repo_root()
    if root is None:
        raise InputError("images build: needs the neuronabox source checkout (pyproject.toml next to the package)")
    client = client or engine_client(what="images build")
    src_hash = _tree_hash(root / "neuronabox") + _hash((root / "pyproject.toml").read_text())
    # The base's name is known before it exists: the wheels are staged while it is being made.
    debian_ref = f"neuronabox/base:{_hash(SUITE, MIRROR, BASE_PACKAGES, _EXCLUDES, 'v1')}"
    base_ref = f"neuronabox/base:{_hash('from', base_image, BASE_PACKAGES)}" if base_image else debian_ref
    # What each image is made of, hence its references, known before anything is made: a cold build
    # starts at once all that it needs (the base, the project's files, each image's wheels).
    deps_of = {n: f"neuronabox/{n}-deps:{_hash(base_ref, _requirements(n, root, torch), python_version, SITE, 'v2')}"
               for n in which if n != "prometheus"}
    key_of = {n: f"neuronabox/{n}:{_hash(d, src_hash, _NBOX_SCRIPT)}" for n, d in deps_of.items()}
    # Prometheus is Debian's package on the Debian base (a layer of apt), not a second rootfs: one
    # mmdebstrap fewer, a minute of a cold build's two cores.
    key_of["prometheus"] = f"neuronabox/prometheus:{_hash(debian_ref, 'prometheus', 'v2')}"
    need_base = any(not _exists(client, d) for d in deps_of.values())
    need_debian = (need_base and not base_image) or ("prometheus" in which and not _exists(client, key_of["prometheus"]))
    need_project = any(not _exists(client, key_of[n]) for n in deps_of)
    scratch = scratch_dir()
    with tempfile.TemporaryDirectory(prefix="nbox-images-", dir=scratch) as tmp, \
            ThreadPoolExecutor(max_workers=len(which) + 2, thread_name_prefix="nbox-images") as pool:
        work = Path(tmp)
        if scratch:
            say(f"staging in {scratch} (tmpfs)")

        def debian_base() -> str:
            if not _exists(client, debian_ref):
                _debian_rootfs(client, debian_ref, BASE_PACKAGES, [], work, say)
            return debian_ref

        def user_base() -> str:
            if not _exists(client, base_ref):
                # Someone else's base (CUDA): the same Debian/Ubuntu packages, by apt, in a layer of ours.
                _docker_build(client, base_ref, f"FROM {base_image}\n{_apt_install(BASE_PACKAGES)}", {}, work,
                              {"nbox.base": base_image}, say)
            return base_ref

        def project() -> dict[str, Path]:
            # One wheel of the checkout, installed once for both images (same Python): two pip builds
            # of one source tree at once share its build/ folder and break each other.
            say("pip wheel neuronabox (this checkout)")
            _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
                  str(work / "wheel"), str(root)], "pip wheel of this checkout")
            site = work / "nbox-site"
            _pip_target(site, ["--no-deps", str(next((work / "wheel").glob("neuronabox-*.whl")))], python_version, say,
                        binary_only=False)
            script = work / "nbox-script"
            script.write_text(_NBOX_SCRIPT)
            script.chmod(0o755)
            return {SITE: site, "/usr/local/bin/nbox": script}

        # Submitted first, so that they start first: the base (mmdebstrap, minutes cold) is on every
        # image's way and waits on nobody.
        debian_made = pool.submit(debian_base) if need_debian else None
        base_made = (pool.submit(user_base) if base_image else debian_made) if need_base else None
        project_made = pool.submit(project) if need_project else None

        def one(name: str) -> Built:
            t0 = time.perf_counter()
            ref, key = image_ref(name, tag), key_of[name]
            cached = _exists(client, key)
            if name == "prometheus":
                if not cached:
                    _docker_build(client, key, f"FROM {debian_made.result()}\n{_apt_install(('prometheus',))}"
                                  "USER prometheus\nENTRYPOINT [\"/usr/bin/prometheus\"]\n"
                                  "CMD [\"--config.file=/etc/prometheus/prometheus.yml\"]\n", {}, work,
                                  {"nbox.layer": "prometheus"}, say)
            elif not cached:
                deps = deps_of[name]
                if not _exists(client, deps):
                    site = work / f"deps-{name}"
                    _pip_target(site, _requirements(name, root, torch), python_version, say)
                    # neuronabox itself goes into the top layer: the deps layer stays cached across edits.
                    for p in site.glob("neuronabox*"):
                        shutil.rmtree(p) if p.is_dir() else p.unlink()
                    # On our Debian base, one import of base and wheels (flattened) instead of an upload
                    # into a container, its commit and its removal: each of the three wrote torch's
                    # gigabyte once more. A user's base (CUDA, gigabytes) keeps its layers.
                    add = _add_layer if base_image else _import_on
                    add(client, base_made.result(), deps, {SITE: site}, ['CMD ["python3"]', "LABEL nbox.layer=deps"],
                        say)
                    shutil.rmtree(site)  # now, not at the end: torch unpacked is a gigabyte
                cmd = ('["python3", "-m", "neuronabox.cluster.docker_runtime", "agent", "--help"]' if name == "stub"
                       else '["nbox", "doctor"]')
                _add_layer(client, deps, key, project_made.result(),
                           ["ENV PYTHONUNBUFFERED=1", f"CMD {cmd}", "LABEL nbox.layer=neuronabox",
                            f"LABEL nbox.source={src_hash}"], say)
            img = client.images.get(key)
            img.tag(*ref.rsplit(":", 1))
            say(f"{ref}: {'cached' if cached else 'built'} ({img.attrs.get('Size', 0) / 1e6:.0f} MB)")
            return Built(name, ref, cached, int(img.attrs.get("Size", 0)), time.perf_counter() - t0)

        out = list(pool.map(one, which))
    return out
