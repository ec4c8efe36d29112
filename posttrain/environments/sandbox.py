"""Run untrusted Python in a bubblewrap (`bwrap`) sandbox: new pid/net/mount/ipc/uts namespaces (plus a
user namespace when not root), a read-only view of only the interpreter's files, a size-capped scratch
tmpfs, a dropped uid when started as root, resource limits, a scrubbed environment, capped output, and
the whole sandbox killed at the time limit. If bwrap or the namespaces are unavailable, nothing runs:
`SandboxUnavailableError` says what is missing.
"""

from __future__ import annotations

import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
SCRATCH_DIR, CODE_DIR = "/scratch", "/code"
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; `make install` does it)"

# Runs inside the sandbox before the user's code: drop root (when the sandbox started as root, with only
# CAP_SETUID/CAP_SETGID kept for this), set the resource limits, then exec the interpreter on the code.
LAUNCHER = """
import os, resource, sys
uid, nproc, memory, cpu, fsize = (int(a) for a in sys.argv[1:6])
if uid >= 0 and os.getuid() == 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
for limit, value in ((resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_AS, memory),
                     (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
os.execv(sys.executable, [sys.executable, "-I", "-B", sys.argv[6]])
"""


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot be set up here; code is never run without it."""


@dataclass
class SandboxLimits:
    """Limits of one run."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 2000
    max_processes: int = 32
    max_file_mb: int = 16
    scratch_mb: int = 64


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None  # None when killed (time limit or output cap)
    timed_out: bool
    output_truncated: bool = False


def bwrap_path() -> str | None:
    """The bubblewrap binary (POSTTRAIN_BWRAP overrides the PATH lookup)."""
    return os.environ.get("POSTTRAIN_BWRAP") or shutil.which("bwrap")


def _readonly_roots() -> list[str]:
    """The directories the interpreter needs: /usr, and the venv and base install wherever they live."""
    roots = ["/usr"]
    for path in (sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parents[1])):
        real = os.path.realpath(path)
        if not any(real == r or real.startswith(r + "/") for r in roots):
            roots.append(real)
    return roots


def _mount_args(code_path: str, scratch_mb: int) -> list[str]:
    args = []
    for top in ("/bin", "/lib", "/lib64", "/sbin"):  # merged-/usr symlinks, or real directories
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    # /tmp first: a venv or interpreter that lives under /tmp (a clone in /tmp) is bound on top of it.
    args += ["--tmpfs", "/tmp"]
    made: set[str] = {"/tmp"}
    for root in _readonly_roots():
        for parent in reversed(Path(root).parents):  # parents bwrap would otherwise create with mode 0700
            if str(parent) != "/" and str(parent) not in made:
                args += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        args += ["--ro-bind", root, root]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--perms", "1777", "--size", str(scratch_mb * 1024 * 1024), "--tmpfs", SCRATCH_DIR]
    args += ["--perms", "0755", "--dir", CODE_DIR, "--ro-bind", code_path, f"{CODE_DIR}/main.py"]
    return args


def _command(bwrap: str, mode: str, code_path: str, limits: SandboxLimits) -> list[str]:
    """The bwrap command line. mode "root": privileged bwrap, then the launcher drops to uid nobody;
    mode "userns": an unprivileged user namespace (the caller's uid, or nobody for root; nobody inside)."""
    namespaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if mode == "root":
        identity = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        identity = ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--disable-userns"]
    environment = [
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        SCRATCH_DIR,
        "--setenv",
        "LANG",
        "C.UTF-8",
    ]
    cpu_s = int(limits.timeout_s) + 1
    launch = [
        sys.executable,
        "-I",
        "-S",
        "-c",
        LAUNCHER,
        str(NOBODY if mode == "root" else -1),
        str(limits.max_processes),
        str(limits.memory_mb * 1024 * 1024),
        str(cpu_s),
        str(limits.max_file_mb * 1024 * 1024),
        f"{CODE_DIR}/main.py",
    ]
    return [
        bwrap,
        *namespaces,
        *identity,
        "--die-with-parent",
        "--new-session",
        *environment,
        *_mount_args(code_path, limits.scratch_mb),
        "--remount-ro",
        "/",
        "--chdir",
        SCRATCH_DIR,
        *launch,
    ]


@functools.cache
def sandbox_mode(bwrap: str | None = None) -> str:
    """The first isolation mode that works here ("root" when running as root, else "userns"), checked
    once per process by running a tiny program in it; raises SandboxUnavailableError otherwise."""
    bwrap = bwrap or bwrap_path()
    if bwrap is None or not os.access(bwrap, os.X_OK):
        raise SandboxUnavailableError(
            f"the code sandbox needs bubblewrap and found no `bwrap` binary: {INSTALL_HINT}"
        )
    failures = []
    for mode in ["root", "userns"] if os.geteuid() == 0 else ["userns"]:
        try:
            result = _run(bwrap, mode, "print('ok')", SandboxLimits(timeout_s=30.0))
        except OSError as error:  # e.g. nobody may not execute bwrap or the interpreter
            failures.append(f"{mode}: {error}")
            continue
        if result.returncode == 0 and result.stdout == "ok\n":
            return mode
        failures.append(f"{mode}: exit {result.returncode}: {result.stderr.strip()[-300:]}")
    raise SandboxUnavailableError(
        "the code sandbox could not create its namespaces with bubblewrap (user namespaces disabled, or a "
        "container without CAP_SYS_ADMIN?); no code is run without isolation. Tried " + "; ".join(failures)
    )


def run_python(code: str, limits: SandboxLimits | None = None, mode: str | None = None) -> SandboxResult:
    """Run `code` with `python -I` in the sandbox; raises SandboxUnavailableError if it cannot be isolated."""
    bwrap = bwrap_path()
    return _run(bwrap, mode or sandbox_mode(bwrap), code, limits or SandboxLimits())


def _run(bwrap: str, mode: str, code: str, limits: SandboxLimits) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as workdir:
        code_path = os.path.join(workdir, "main.py")
        with open(code_path, "w") as f:
            f.write(code)
        os.chmod(workdir, 0o755)
        os.chmod(code_path, 0o644)
        # Root taking the user-namespace path becomes nobody first: inside a namespace that maps to
        # root, the kernel would exempt the code from RLIMIT_NPROC.
        as_nobody = (
            {"user": NOBODY, "group": NOBODY, "extra_groups": []}
            if mode == "userns" and os.geteuid() == 0
            else {}
        )
        process = subprocess.Popen(
            _command(bwrap, mode, code_path, limits),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
            **as_nobody,
        )
        try:
            return _collect(process, limits)
        finally:
            _kill_group(process)


def _collect(process: subprocess.Popen, limits: SandboxLimits) -> SandboxResult:
    """Read stdout and stderr as they stream, up to the byte cap each; stop the sandbox at the time limit
    or as soon as the output passes the cap."""
    buffers = {"stdout": bytearray(), "stderr": bytearray()}
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ, "stdout")
    selector.register(process.stderr, selectors.EVENT_READ, "stderr")
    deadline = time.monotonic() + limits.timeout_s
    timed_out = truncated = False
    while selector.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        for key, _ in selector.select(timeout=remaining):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                selector.unregister(key.fileobj)
                continue
            buffer = buffers[key.data]
            truncated = truncated or len(buffer) + len(chunk) > limits.max_output_bytes
            buffer += chunk[: max(0, limits.max_output_bytes - len(buffer))]
        if truncated:
            break
    selector.close()
    if not (timed_out or truncated):
        try:  # the streams closed; the code may still run (it closed them itself) until the deadline
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out or truncated:
        _kill_group(process)
    returncode = None if timed_out or truncated else process.returncode
    return SandboxResult(
        buffers["stdout"].decode(errors="replace"),
        buffers["stderr"].decode(errors="replace"),
        returncode,
        timed_out,
        truncated,
    )


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL bwrap's process group; bwrap's pid-namespace init dies with it (--die-with-parent), and the
    kernel then kills every process left in the namespace, setsid'd grandchildren included."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()
