"""``nbox images build``: the docker runtime's images, made here without a registry (cluster/images.py)."""

from __future__ import annotations

from typing import List, Optional

import typer

from . import app, console

images_app = typer.Typer(help="Images of the docker runtime (built from Debian packages, no registry).",
                         no_args_is_help=True)
app.add_typer(images_app, name="images")


@images_app.command("build")
def build_cmd(
    which: List[str] = typer.Argument(None, help="stub, node, prometheus (default: all three)."),
    tag: str = typer.Option("latest", "--tag", help="Tag of the neuronabox/<image> references."),
    base_image: Optional[str] = typer.Option(None, "--base-image",
                                             help="Build the stub and node images on this image (e.g. a CUDA one) "
                                                  "instead of a Debian rootfs."),
    python_version: str = typer.Option("3.11", "--python-version", help="The base image's python3 (X.Y)."),
    torch: str = typer.Option("torch==2.13.0", "--torch", help="The node image's torch requirement or wheel file."),
) -> None:
    """Build (or find cached) neuronabox/stub, neuronabox/node and neuronabox/prometheus."""
    from ..cluster.images import IMAGES, build

    built = build(which or IMAGES, tag=tag, base_image=base_image, python_version=python_version, torch=torch,
                  progress=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False))
    for b in built:
        console.print(f"{b.ref}: {'cached' if b.cached else 'built'}, {b.size / 1e6:.0f} MB, {b.seconds:.1f} s",
                      highlight=False)
