"""Images of the docker runtime, built without a registry: ``nbox images build``.

Nothing here is pulled. Each image is three layers, each one an image tagged by the hash of
what it is made of, so that a layer whose inputs did not change is found in the engine and not
made again (a second ``build`` takes seconds):

1. the **base**: a Debian rootfs made by ``mmdebstrap --variant=minbase`` (python3, iproute2,
   iptables, ping, ps) and ``docker import``-ed; or the image the user names (``--base-image``,
   e.g. an NVIDIA CUDA image for a GPU node), completed with the same Debian packages by apt;
2. the **dependencies**: the Python packages the image needs, installed on the host by pip
   (``pip install --target`` for the image's Python, wheels only) and put into a container of
   the layer below, which is committed (``_add_layer``); the stub image
   carries no torch, the node image adds torch (the CPU wheel unless ``--torch`` names another);
3. **neuronabox** itself, one wheel of this checkout (``pip wheel --no-deps``) shared by the images,
   and an ``nbox`` script.

``prometheus`` is a rootfs of Debian's own ``prometheus`` package (no registry image).

All images are made at once (a cold build mostly waits on the Debian mirror and the engine).
The engine is reached through the Docker SDK only (``docker_runtime.client``). A build that is
interrupted leaves no tag: each tag is set by the engine's last step; the staging container,
the staging folder and mmdebstrap's chroot are removed on the way out.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
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


def _run(cmd: list[str], what: str) -> None:
    """Run a build step; on an interrupt, stop it with SIGTERM so that it removes its own work folder."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    _run(cmd, "mmdebstrap")
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


def _add_layer(client, parent: str, ref: str, files: dict[str, Path], changes: Sequence[str], say) -> None:
    """Image ``ref``: ``parent`` with the host folders ``files`` (image path -> host path) put in, one layer.

    A container's archive upload and a commit: a third of the time ``docker build``'s COPY took for
    torch's gigabyte here (the build context is written once more, then copied, then committed)."""
    say(f"adding {', '.join(files)} to {parent} as {ref}")
    r, w = os.pipe()

    def produce() -> None:
        with os.fdopen(w, "wb") as f, tarfile.open(fileobj=f, mode="w|") as tar:
            for dest, src in files.items():
                tar.add(str(src), arcname=dest.lstrip("/"))

    def chunks():
        with os.fdopen(r, "rb") as f:
            while chunk := f.read(1 << 20):
                yield chunk

    container = client.containers.create(parent, ["true"], labels={"nbox.build": ref})
    try:
        threading.Thread(target=produce, daemon=True, name="nbox-layer-tar").start()
        container.put_archive("/", chunks())
        repo, tag = ref.rsplit(":", 1)
        container.commit(repo, tag, changes=list(changes))
    finally:
        # Also on an interrupt: the staging container never outlives the build.
        container.remove(force=True)


def _project_requirements(root: Path) -> list[str]:
    """neuronabox's own dependencies (no extras), as the installed checkout declares them."""
    from importlib.metadata import requires

    # The checkout is installed editable (make venv), so its metadata follows pyproject.toml.
    return sorted(r for r in (requires("neuronabox") or []) if "extra ==" not in r)


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
    base_ref = (f"neuronabox/base:{_hash('from', base_image, BASE_PACKAGES)}" if base_image
                else f"neuronabox/base:{_hash(SUITE, MIRROR, BASE_PACKAGES, _EXCLUDES, 'v1')}")
    base_lock = threading.Lock()
    wheel_lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="nbox-images-") as tmp:
        work = Path(tmp)

        def project_wheel() -> Path:
            # One wheel of the checkout for every image: two pip builds of one source tree at once
            # share its build/ folder and break each other (seen: a stub and a node build together).
            with wheel_lock:
                made = sorted((work / "wheel").glob("neuronabox-*.whl"))
                if not made:
                    say("pip wheel neuronabox (this checkout)")
                    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
                          str(work / "wheel"), str(root)], "pip wheel of this checkout")
                    made = sorted((work / "wheel").glob("neuronabox-*.whl"))
                return made[0]

        def base() -> str:
            with base_lock:  # stub and node share it: made once
                if _exists(client, base_ref):
                    return base_ref
                if base_image:
                    # Someone else's base (CUDA): the same Debian/Ubuntu packages, by apt, in a layer of ours.
                    _docker_build(client, base_ref, f"FROM {base_image}\nRUN apt-get update && DEBIAN_FRONTEND="
                                  f"noninteractive apt-get install -y --no-install-recommends {' '.join(BASE_PACKAGES)}"
                                  " && rm -rf /var/lib/apt/lists/*\n", {}, work, {"nbox.base": base_image}, say)
                else:
                    _debian_rootfs(client, base_ref, BASE_PACKAGES, [], work, say)
            return base_ref

        def one(name: str) -> Built:
            t0 = time.perf_counter()
            ref = image_ref(name, tag)
            if name == "prometheus":
                key = f"neuronabox/prometheus:{_hash(SUITE, MIRROR, 'prometheus', _EXCLUDES, 'v1')}"
                cached = _exists(client, key)
                if not cached:
                    _debian_rootfs(client, key, ("prometheus",), [
                        'ENTRYPOINT ["/usr/bin/prometheus"]',
                        'CMD ["--config.file=/etc/prometheus/prometheus.yml"]', "USER prometheus"], work, say)
            else:
                reqs = STUB_REQUIREMENTS if name == "stub" else (*_project_requirements(root), torch)
                deps = f"neuronabox/{name}-deps:{_hash(base_ref, reqs, python_version, SITE, 'v2')}"
                if not _exists(client, deps):
                    site = work / f"deps-{name}"
                    _pip_target(site, reqs, python_version, say)
                    # neuronabox itself goes into the top layer: the deps layer stays cached across edits.
                    for p in site.glob("neuronabox*"):
                        shutil.rmtree(p) if p.is_dir() else p.unlink()
                    _add_layer(client, base(), deps, {SITE: site}, ['CMD ["python3"]', "LABEL nbox.layer=deps"], say)
                key = f"neuronabox/{name}:{_hash(deps, src_hash, _NBOX_SCRIPT)}"
                cached = _exists(client, key)
                if not cached:
                    site = work / f"nbox-{name}"
                    _pip_target(site, ["--no-deps", str(project_wheel())], python_version, say, binary_only=False)
                    script = work / f"nbox-script-{name}"
                    script.write_text(_NBOX_SCRIPT)
                    script.chmod(0o755)
                    cmd = ('["python3", "-m", "neuronabox.cluster.docker_runtime", "agent", "--help"]' if name == "stub"
                           else '["nbox", "doctor"]')
                    _add_layer(client, deps, key, {SITE: site, "/usr/local/bin/nbox": script},
                               ["ENV PYTHONUNBUFFERED=1", f"CMD {cmd}", "LABEL nbox.layer=neuronabox",
                                f"LABEL nbox.source={src_hash}"], say)
            img = client.images.get(key)
            img.tag(*ref.rsplit(":", 1))
            say(f"{ref}: {'cached' if cached else 'built'} ({img.attrs.get('Size', 0) / 1e6:.0f} MB)")
            return Built(name, ref, cached, int(img.attrs.get("Size", 0)), time.perf_counter() - t0)

        # All at once: a cold build is mostly waiting (on the Debian mirror, on the engine), and
        # the wheels of stub and node are staged while the base is being made.
        with ThreadPoolExecutor(max_workers=max(1, len(which)), thread_name_prefix="nbox-images") as pool:
            out = list(pool.map(one, which))
    return out
