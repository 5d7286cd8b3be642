"""Build the gateway's container image from the top-level Containerfile with podman: what `make image` runs
(docs/operations.md, "Container and Kubernetes"; tests/deploy/test_container.py builds with it too).

Two ways, chosen by --base-image:

- without it (`make image`): on local Debian bases, for a machine that reaches no container registry.
  mmdebstrap makes two bookworm roots (the runtime's: python3 alone; the build stage's: with gcc, the headers
  and venv), `podman import` makes them images; the roots are cached as tarballs in ~/.cache/fanout-gateway/
  (FANOUT_IMAGE_CACHE, --cache), about a minute each, once. The build installs its Python packages from a
  wheelhouse that `pip download` fills on the host (PIP_NO_INDEX, PIP_FIND_LINKS), for the base's own Python.
- with it (`make image BASE_IMAGE=python:3.11-slim`): the usual build on that registry image, its packages
  from PyPI inside the build.

podman runs with a containers.conf of this script's (runtime runc, no default ulimits: sandboxes that refuse
crun's cgroup set-up or the default ulimits run it so), written in the cache folder, unless CONTAINERS_CONF
names one already. Runs on the checkout's venv (.venv/bin/python: the standard library and pip).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path
from typing import TypedDict

# pip's own copy of `packaging`: the venv of `make run` has no other (pip is pinned by constraints.txt)
from pip._vendor.packaging.markers import default_environment
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = Path(os.environ.get("FANOUT_IMAGE_CACHE", Path.home() / ".cache" / "fanout-gateway"))
DEFAULT_TAG = "localhost/fanout-gateway:latest"
#: the Debian release of the local bases: this machine's (its apt sources have it)
SUITE = "bookworm"
BASES = {
    "runtime": ["python3", "ca-certificates"],
    "build": ["python3", "python3-venv", "python3-dev", "gcc", "libc6-dev", "ca-certificates"],
}
#: what the local bases leave out, as slim images do (dpkg never unpacks it): manuals, translations, documentation
SLIM = [f"--dpkgopt=path-exclude=/usr/share/{folder}/*" for folder in ("doc", "man", "info", "locale")]
CONTAINERS_CONF = '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n'


class BuildError(Exception):
    pass


class Report(TypedDict):
    """What was built, and the figures (--report writes it as JSON)."""

    image: str
    base: str
    build_image: str
    build_s: float
    size: int
    base_size: int
    #: the containers.conf podman ran with (a `podman run` of the image here needs it too), if any
    containers_conf: str | None


def say(line: str) -> None:
    print(f"build-image: {line}", flush=True)


def run(
    *args: str, env: dict[str, str], timeout: float = 900, check: bool = True, quiet: bool = True
) -> subprocess.CompletedProcess[str]:
    """`args`, its output captured (shown when it fails); `quiet=False` lets it print as it goes."""
    try:
        done = subprocess.run(
            args,
            env=env,
            timeout=timeout,
            text=True,
            stdout=subprocess.PIPE if quiet else None,
            stderr=subprocess.PIPE if quiet else None,
        )
    except FileNotFoundError:
        raise BuildError(f"{args[0]} is not installed (`make podman` installs podman, runc and mmdebstrap)") from None
    except subprocess.TimeoutExpired:
        raise BuildError(f"`{shlex.join(args)}` took more than {timeout:.0f} s") from None
    if check and done.returncode != 0:
        shown = ((done.stdout or "")[-3000:] + (done.stderr or "")[-3000:]).strip()
        raise BuildError(f"`{shlex.join(args)}` exited {done.returncode}" + (f":\n{shown}" if shown else ""))
    return done


def podman_env(cache: Path) -> dict[str, str]:
    """The environment podman runs in: CONTAINERS_CONF as given, else this script's file (runc, no ulimits)."""
    if os.environ.get("CONTAINERS_CONF"):
        return dict(os.environ)
    conf = cache / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        cache.mkdir(parents=True, exist_ok=True)
        conf.write_text(CONTAINERS_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def local_base(name: str, cache: Path, env: dict[str, str]) -> str:
    """The local base `name`, imported from its cached mmdebstrap tarball (made first when missing); the
    tarball's name carries a digest of how it is made, so a changed package list makes a new one."""
    packages = BASES[name]
    recipe = hashlib.sha256(json.dumps([SUITE, sorted(packages), SLIM]).encode()).hexdigest()[:12]
    tag = f"localhost/fanout-gateway-base-{name}:{SUITE}-{recipe}"
    tarball = cache / f"base-{name}-{SUITE}-{recipe}.tar"
    if not tarball.exists():
        say(f"making the {name} base with mmdebstrap ({SUITE}: {' '.join(packages)}; about a minute, once)")
        cache.mkdir(parents=True, exist_ok=True)
        partial = tarball.with_name(tarball.stem + ".partial.tar")  # mmdebstrap: the suffix says the format
        run(
            "mmdebstrap", "--variant=minbase", *SLIM, "--include=" + ",".join(packages), SUITE, str(partial), env=env, timeout=900
        )
        partial.rename(tarball)
        run("podman", "rmi", "-f", tag, env=env, check=False)
    if run("podman", "image", "exists", tag, env=env, check=False).returncode != 0:
        run("podman", "import", "-q", str(tarball), tag, env=env)
    return tag


def fill_wheelhouse(wheelhouse: Path, base: str, env: dict[str, str]) -> None:
    """Every wheel the image's build installs, for `base`'s own Python: the serving set, pip, setuptools and
    [build-system]'s packages at constraints.txt's pins, then what their markers ask for on that Python (the
    lock is resolved on a newer 3.11: redis needs async-timeout below 3.11.3, which bookworm's 3.11.2 is)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = ["pip", "setuptools", *project["project"]["dependencies"], *project["build-system"]["requires"]]
    # filled before for the same base (its image id), the same packages and the same pins: every wheel is there
    # (constraints.txt pins each one, so a new fill would fetch the same files)
    inputs = [image_id(base, env), wanted, (ROOT / "constraints.txt").read_text(), platform.machine()]
    stamp = wheelhouse / f".filled-{hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]}.json"
    if stamp.exists() and all((wheelhouse / name).exists() for name in json.loads(stamp.read_text())):
        return
    probe = (
        "import json, platform; print(json.dumps({'python_full_version': platform.python_version(), "
        "'python_version': '.'.join(platform.python_version_tuple()[:2]), 'implementation_version': "
        "platform.python_version(), 'platform_machine': platform.machine()}))"
    )
    theirs = json.loads(run("podman", "run", "--rm", base, "python3", "-c", probe, env=env).stdout)
    if theirs["platform_machine"] != platform.machine():
        raise BuildError(
            f"the base is {theirs['platform_machine']}, this machine {platform.machine()}: the "
            "wheelhouse is filled with this machine's wheels"
        )
    markers = {**{key: str(value) for key, value in default_environment().items()}, **theirs}
    wheelhouse.mkdir(parents=True, exist_ok=True)
    missing: set[str] = set()
    for _ in range(5):
        run(
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--only-binary=:all:",
            "-d",
            str(wheelhouse),
            "-c",
            str(ROOT / "constraints.txt"),
            *wanted,
            env=env,
        )
        have = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheelhouse.glob("*.whl")}
        missing = set()
        for wheel in wheelhouse.glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
                lines = archive.read(metadata).decode().splitlines()
            for line in lines:
                if line.startswith("Requires-Dist: "):
                    requirement = Requirement(line.removeprefix("Requires-Dist: "))
                    if (not requirement.marker or requirement.marker.evaluate({**markers, "extra": ""})) and canonicalize_name(
                        requirement.name
                    ) not in have:
                        missing.add(str(requirement).split(";")[0])
        if not missing:
            stamp.write_text(json.dumps(sorted(w.name for w in wheelhouse.glob("*.whl"))) + "\n")
            return
        wanted += sorted(missing)
    raise BuildError(f"the wheelhouse still lacks {sorted(missing)}")


def image_id(tag: str, env: dict[str, str]) -> str | None:
    done = run("podman", "image", "inspect", "--format", "{{.Id}}", tag, env=env, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def tags(image: str, env: dict[str, str]) -> list[str]:
    """The names `image` (an id) still has: another build of the same sources (podman's layer cache) is the same
    image under a second name, which removing the id would remove too."""
    done = run("podman", "image", "inspect", "--format", "{{json .RepoTags}}", image, env=env, check=False)
    return list(json.loads(done.stdout)) if done.returncode == 0 and done.stdout.strip() not in ("", "null") else []


def size(tag: str, env: dict[str, str]) -> int:
    return int(run("podman", "image", "inspect", "--format", "{{.Size}}", tag, env=env).stdout)


def build(args: argparse.Namespace) -> Report:
    cache: Path = args.cache
    env = podman_env(cache)
    build_args: list[str] = []
    volumes: list[str] = []
    if args.base_image:
        base, build_base = args.base_image, args.build_image or args.base_image
        say(f"on {base} (build stage: {build_base}), packages from PyPI inside the build")
    else:
        say(f"on local Debian {SUITE} bases (mmdebstrap, cached in {cache}), packages from a wheelhouse")
        base, build_base = local_base("runtime", cache, env), local_base("build", cache, env)
        wheelhouse = cache / "wheelhouse"
        say(f"filling {wheelhouse} for the base's Python (pip download on this machine)")
        fill_wheelhouse(wheelhouse, build_base, env)
        build_args = ["--build-arg", "PIP_NO_INDEX=1", "--build-arg", "PIP_FIND_LINKS=/wheelhouse"]
        volumes = ["-v", f"{wheelhouse}:/wheelhouse:ro"]
    replaced = image_id(args.tag, env)
    say(f"podman build -t {args.tag} (most of it compiling the core: about a minute)")
    started = time.monotonic()
    podman_build = [
        "podman",
        "build",
        "--format",
        "docker",
        "--network",
        "host",
        "-f",
        str(ROOT / "Containerfile"),
        "--build-arg",
        f"BASE_IMAGE={base}",
        "--build-arg",
        f"BUILD_IMAGE={build_base}",
        *build_args,
        *volumes,
    ]
    if args.build_stage_tag:
        # the build stage under a name of its own: not dangling, `podman image prune` keeps it, and the next
        # build reuses its layers (podman's cache, keyed by the files copied) instead of compiling again; the
        # build below then takes the whole stage from that cache
        run(*podman_build, "--target", "build", "-t", args.build_stage_tag, str(ROOT), env=env, timeout=1800, quiet=args.quiet)
    run(*podman_build, "-t", args.tag, str(ROOT), env=env, timeout=1800, quiet=args.quiet)
    built = time.monotonic() - started
    if replaced and replaced != image_id(args.tag, env) and not tags(replaced, env):
        run("podman", "rmi", replaced, env=env, check=False)  # the build this one replaced, if no tag or container has it
    return Report(
        image=args.tag,
        base=base,
        build_image=build_base,
        build_s=round(built, 1),
        size=size(args.tag, env),
        base_size=size(base, env),
        containers_conf=env.get("CONTAINERS_CONF"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="build-image.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--base-image",
        metavar="IMAGE",
        help="a registry image with python3 (3.11+) and apt, such as python:3.11-slim: the usual build, "
        "its packages from PyPI. Default: local Debian bases made with mmdebstrap, and a wheelhouse",
    )
    parser.add_argument("--build-image", metavar="IMAGE", help="the build stage's image, with --base-image (default: the same)")
    parser.add_argument("--tag", default=DEFAULT_TAG, help=f"the image's name (default {DEFAULT_TAG})")
    parser.add_argument(
        "--cache",
        type=Path,
        default=DEFAULT_CACHE,
        metavar="DIR",
        help=f"the bases' tarballs, the wheelhouse and the containers.conf (default {DEFAULT_CACHE}; FANOUT_IMAGE_CACHE)",
    )
    parser.add_argument(
        "--build-stage-tag",
        metavar="TAG",
        help="also name the build stage (the compiled wheel, the serving set) TAG: a later build of the same "
        "sources and pins then reuses it from podman's cache, even after a `podman image prune`",
    )
    parser.add_argument("--report", type=Path, metavar="FILE", help="also write the figures (seconds, bytes) as JSON")
    parser.add_argument("--quiet", action="store_true", help="keep podman build's output (shown if it fails)")
    args = parser.parse_args(argv)
    if args.build_image and not args.base_image:
        parser.error("--build-image goes with --base-image")
    try:
        report = build(args)
    except BuildError as error:
        print(f"build-image: {error}", file=sys.stderr)
        return 1
    if args.report:
        args.report.write_text(json.dumps(report, indent=1) + "\n")
    conf = f"CONTAINERS_CONF={report['containers_conf']} " if report["containers_conf"] else ""
    say(
        f"built {args.tag}: {report['size'] / 1e6:.0f} MB (base {report['base_size'] / 1e6:.0f} MB) in "
        f"{report['build_s']:.0f} s. Run it (`podman stop -t 30` drains it):"
    )
    print(f'  {conf}podman run --rm --network host -e GATEWAY_SERVER_ADMIN_TOKEN="$(openssl rand -hex 16)" {args.tag}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
