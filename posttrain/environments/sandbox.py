"""Run untrusted Python in a bubblewrap (`bwrap`) sandbox: new pid/net/mount/ipc/uts namespaces (plus a
user namespace when not root), a read-only view of only the interpreter's files, a size-capped scratch
tmpfs, a dropped uid when started as root, resource limits, a scrubbed environment, capped output, and
the whole sandbox killed at the time limit. If bwrap or the namespaces are unavailable, nothing runs:
`SandboxUnavailableError` says what is missing.

Limits that hold for the sandbox as a whole, however its code forks: no new namespaces and no mounts from
inside (`seccomp_program`; in the user-namespace mode bwrap's `--disable-userns` too; without pyseccomp
the root mode refuses to run), and one memory and process budget for all of its processes and the tmpfs
pages they write (`create_cgroup`; where no cgroup can be made, that is logged once and only the
per-process limits hold: RLIMIT_AS of `memory_mb` per process, `max_processes` processes)."""

from __future__ import annotations

import errno
import functools
import logging
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

log = logging.getLogger(__name__)

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
os.execv(sys.executable, [sys.executable, "-I", "-B", sys.argv[6]])"""


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
    memory_peak_bytes: int | None = None  # the whole sandbox's peak memory, where a cgroup measured it
    memory_exceeded: bool = False  # the cgroup's limit was hit (a process of the sandbox was OOM-killed)


CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80)
# io_uring performs syscalls this filter would not see.
REFUSED_SYSCALLS = tuple(
    "unshare setns mount umount2 pivot_root chroot open_tree move_mount fsopen fsconfig fsmount fspick "
    "mount_setattr keyctl add_key request_key bpf perf_event_open userfaultfd kexec_load init_module "
    "finit_module swapon swapoff io_uring_setup io_uring_enter io_uring_register".split()
)


@functools.cache
def seccomp_program() -> bytes | None:
    """The compiled seccomp filter of the sandbox (BPF bytes for `bwrap --seccomp`): every syscall allowed
    except REFUSED_SYSCALLS (EPERM), clone with a new-namespace flag (EPERM), and clone3 (ENOSYS, whose
    flags a filter cannot read: the C library then falls back to clone). None without pyseccomp.
    Built once per process."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError):  # not installed, or no libseccomp.so.2
        return None
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in REFUSED_SYSCALLS:
        try:
            rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (OSError, ValueError, RuntimeError):  # not a syscall of this architecture
            continue
    for flag in CLONE_NEW_FLAGS:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as program:
        rules.export_bpf(program)
        program.seek(0)
        return program.read()


CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass
class SandboxCgroup:
    """The cgroup(s) of one run: one on v2; on v1 one in the memory and one in the pids hierarchy."""

    version: int
    paths: list[Path]

    def memory_stats(self) -> tuple[int | None, bool]:
        """(peak bytes, whether the memory limit OOM-killed a process)."""
        memory = self.paths[0]
        if self.version == 2:
            peak = memory / "memory.peak"
            events = dict(line.split() for line in (memory / "memory.events").read_text().splitlines())
            return (int(peak.read_text()) if peak.exists() else None), int(events.get("oom_kill", 0)) > 0
        control = dict(line.split() for line in (memory / "memory.oom_control").read_text().splitlines())
        return int((memory / "memory.max_usage_in_bytes").read_text()), int(control.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        """Remove the (empty) groups; their processes are gone once the sandbox was killed."""
        for path in self.paths:
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # a process still exiting
                    time.sleep(0.02)


def _v2_parent() -> Path | None:
    """The v2 group this process may create children in, with memory and pids enabled for them."""
    if not (CGROUP_ROOT / "cgroup.controllers").exists():
        return None
    own = next(
        (line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")),
        None,
    )
    if own is None:
        return None
    parent = CGROUP_ROOT / own.strip("/")
    enabled = set((parent / "cgroup.subtree_control").read_text().split())
    if not {"memory", "pids"} <= enabled:
        try:
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
        except OSError:
            return None
    return parent


def create_cgroup(limits: SandboxLimits, owner: int | None) -> SandboxCgroup | None:
    """A fresh cgroup holding `limits.memory_mb` of memory (swap included where accounted) and
    `limits.max_processes` processes; its cgroup.procs files handed to uid `owner` (the sandbox's launcher
    moves itself in). None where no cgroup can be made here."""
    name = f"posttrain-sandbox-{os.getpid()}-{time.monotonic_ns()}"
    memory_bytes = str(limits.memory_mb * 1024 * 1024)
    try:
        parent = _v2_parent()
        if parent is not None:
            group = SandboxCgroup(2, [parent / name])
            group.paths[0].mkdir()
            (group.paths[0] / "memory.max").write_text(memory_bytes)
            if (group.paths[0] / "memory.swap.max").exists():
                (group.paths[0] / "memory.swap.max").write_text("0")
            (group.paths[0] / "pids.max").write_text(str(limits.max_processes))
        elif (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists() and (CGROUP_ROOT / "pids").is_dir():
            group = SandboxCgroup(1, [CGROUP_ROOT / "memory" / name, CGROUP_ROOT / "pids" / name])
            for path in group.paths:
                path.mkdir()
            memory = group.paths[0]
            (memory / "memory.limit_in_bytes").write_text(memory_bytes)
            if (memory / "memory.memsw.limit_in_bytes").exists():
                (memory / "memory.memsw.limit_in_bytes").write_text(memory_bytes)
            (group.paths[1] / "pids.max").write_text(str(limits.max_processes))
        else:
            _warn_no_cgroup("neither a v2 group with memory and pids nor v1 memory and pids hierarchies")
            return None
    except OSError as error:
        _warn_no_cgroup(f"{type(error).__name__}: {error}")
        return None
    if owner is not None:
        for path in group.paths:
            os.chown(path / "cgroup.procs", owner, owner)
    return group


@functools.cache
def _warn_no_cgroup(reason: str) -> None:
    log.warning(
        "code sandbox: no cgroup can be made here (%s); memory and processes are limited per process "
        "only (RLIMIT_AS, RLIMIT_NPROC), not for the sandbox as a whole",
        reason,
    )


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


def _command(
    bwrap: str,
    mode: str,
    code_path: str,
    limits: SandboxLimits,
    seccomp_fd: int | None = None,
    cgroup: SandboxCgroup | None = None,
) -> list[str]:
    """The bwrap command line. mode "root": privileged bwrap, then the launcher drops to uid nobody;
    mode "userns": an unprivileged user namespace (the caller's uid, or nobody for root; nobody inside).
    With a cgroup, a shell moves itself into it first and then becomes bwrap, so that every process of the
    sandbox starts inside."""
    namespaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if mode == "root":
        identity = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        identity = ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--disable-userns"]
    environment = ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", SCRATCH_DIR]
    environment += ["--setenv", "LANG", "C.UTF-8"]
    limit_args = (
        NOBODY if mode == "root" else -1,
        limits.max_processes,
        limits.memory_mb * 1024 * 1024,
        int(limits.timeout_s) + 1,  # CPU seconds
        limits.max_file_mb * 1024 * 1024,
    )
    launch = [sys.executable, "-I", "-S", "-c", LAUNCHER, *map(str, limit_args), f"{CODE_DIR}/main.py"]
    enter = []
    if cgroup is not None:
        moves = " && ".join(f'echo $$ > "{path}/cgroup.procs"' for path in cgroup.paths)
        enter = ["/bin/sh", "-c", moves + ' && exec "$@"', "sh"]
    seccomp = ["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []
    command = [*enter, bwrap, *namespaces, *identity, *seccomp, "--die-with-parent", "--new-session"]
    command += [*environment, *_mount_args(code_path, limits.scratch_mb), "--remount-ro", "/"]
    return command + ["--chdir", SCRATCH_DIR, *launch]


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
    program = seccomp_program()
    if program is None and mode == "root":
        raise SandboxUnavailableError(
            "the code sandbox's root mode needs a seccomp filter to refuse new namespaces and mounts: "
            "pip install pyseccomp (and libseccomp2, which most Linux systems have)"
        )
    # Root taking the user-namespace path becomes nobody first: inside a namespace that maps to
    # root, the kernel would exempt the code from RLIMIT_NPROC.
    as_nobody = mode == "userns" and os.geteuid() == 0
    with (
        tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as workdir,
        tempfile.TemporaryFile() as rules,
    ):
        code_path = os.path.join(workdir, "main.py")
        with open(code_path, "w") as f:
            f.write(code)
        os.chmod(workdir, 0o755)
        os.chmod(code_path, 0o644)
        if program is not None:
            rules.write(program)
            rules.seek(0)
        cgroup = create_cgroup(limits, owner=NOBODY if as_nobody else None)
        try:
            process = subprocess.Popen(
                _command(bwrap, mode, code_path, limits, rules.fileno() if program else None, cgroup),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={"PATH": "/usr/bin:/bin"},
                start_new_session=True,
                pass_fds=(rules.fileno(),) if program else (),
                **({"user": NOBODY, "group": NOBODY, "extra_groups": []} if as_nobody else {}),
            )
            try:
                result = _collect(process, limits)
            finally:
                _kill_group(process)
            if cgroup is not None:
                result.memory_peak_bytes, result.memory_exceeded = cgroup.memory_stats()
            return result
        finally:
            if cgroup is not None:
                cgroup.remove()


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
    stdout, stderr = (buffers[name].decode(errors="replace") for name in ("stdout", "stderr"))
    return SandboxResult(stdout, stderr, returncode, timed_out, truncated)


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
